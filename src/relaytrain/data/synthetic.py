"""The embedded default data: generated from a seed, needs no file, tokenizer or network.

It is learnable, so the loss visibly falls within a few dozen steps:
- classification: each class owns a few "signal" tokens; a sample of class c carries some
  of c's signal tokens among random filler, so a bag-of-words already separates classes;
- causal / masked LM: each sequence is an arithmetic progression (mod a window of the
  vocabulary) from a random start with one of a few strides, so tokens are predictable from
  their neighbours.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from relaytrain.data import labels
from relaytrain.data.dataset import TokenDataset

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective

FIRST_TOKEN = 5  # ids below this are left for special tokens ([PAD], [CLS], [SEP], [MASK], [UNK])
CLS_ID, MASK_ID = 1, 3
STRIDES = (1, 2, 3, 5)
SIGNALS_PER_CLASS = 4
MLM_MASK_RATE = 0.15


def synthetic_dataset(objective: Objective, vocab_size: int, num_labels: int, num_samples: int, seq_len: int,
                      seed: int) -> TokenDataset:
    """`num_samples` samples of `seq_len` tokens below `vocab_size`, labelled for the run's
    `objective` (`num_labels` classes where it classifies)."""
    g = torch.Generator().manual_seed(seed)
    window = min(vocab_size - FIRST_TOKEN, 4096)
    rows = objective.rows_per_item  # a preference pair: two rows an item (its chosen, its rejected), drawn alike
    if labels.class_labels(objective):
        return dataclasses.replace(_classification(num_samples * rows, seq_len, window, num_labels, g),
                                   rows_per_item=rows)
    ids = _progressions(num_samples * rows, seq_len, window, g)
    if labels.next_token_labels(objective):
        return TokenDataset(ids, ids.clone(), rows_per_item=rows)
    return _mask_tokens(ids, g)


def _classification(n: int, seq_len: int, window: int, num_labels: int, g: torch.Generator) -> TokenDataset:
    labels = torch.randint(0, num_labels, (n,), generator=g)
    signal_base = FIRST_TOKEN  # class c's signal tokens: signal_base + c*SIGNALS_PER_CLASS + [0, 4)
    filler_low = FIRST_TOKEN + num_labels * SIGNALS_PER_CLASS
    ids = torch.randint(filler_low, FIRST_TOKEN + window, (n, seq_len), generator=g)
    num_signals = max(1, seq_len // 8)
    positions = torch.rand(n, seq_len - 1, generator=g).argsort(dim=1)[:, :num_signals] + 1
    signals = signal_base + labels[:, None] * SIGNALS_PER_CLASS + torch.randint(
        0, SIGNALS_PER_CLASS, (n, num_signals), generator=g
    )
    ids.scatter_(1, positions, signals)
    ids[:, 0] = CLS_ID
    return TokenDataset(ids, labels)


def _progressions(n: int, seq_len: int, window: int, g: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, window, (n, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (n, 1), generator=g)]
    return FIRST_TOKEN + (start + stride * torch.arange(seq_len)) % window


def _mask_tokens(ids: torch.Tensor, g: torch.Generator) -> TokenDataset:
    chosen = torch.rand(ids.shape, generator=g) < MLM_MASK_RATE
    chosen[:, 0] = True  # at least one predicted token per sample
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return TokenDataset(torch.where(chosen, torch.full_like(ids, MASK_ID), ids), labels)
