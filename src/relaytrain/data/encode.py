"""Samples and token rows -> a `TokenDataset` with the labels the model's task asks for
(`data/labels.py` answers which): padding, class labels, causal-LM labels, masked-LM masking.

Pre-tokenized input without a configured tokenizer follows the synthetic data's ids:
[PAD]=0, [CLS]=1, [SEP]=2, [MASK]=3, [UNK]=4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from relaytrain.data import labels
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.labels import IGNORE_INDEX
from relaytrain.data.samples import Sample
from relaytrain.data.synthetic import FIRST_TOKEN, MASK_ID, MLM_MASK_RATE
from relaytrain.data.tokenizer import find_tokenizer, load_tokenizer
from relaytrain.utils.errors import ConfigError

if TYPE_CHECKING:
    from relaytrain.models.family import Family
    from relaytrain.objectives.base import Objective


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    mask: int | None
    special: tuple[int, ...]  # never chosen for masked-LM prediction


DEFAULT_SPECIAL_IDS = SpecialIds(pad=0, mask=MASK_ID, special=tuple(range(FIRST_TOKEN)))


def encode_samples(cfg, groups: list[list[Sample]], tokenizer_dir: str | None, objective: Objective,
                   family: Family) -> list[TokenDataset]:
    """Each group of samples (training, then held-out) -> padded tensors with labels for the
    run's `objective`, one sample per row, all with one tokenizer: the configured one, or one
    trained on the first group's text (the kind the model's `family` trains)."""
    texts = [s.text for s in groups[0] if s.input_ids is None]
    if texts or any(s.input_ids is None for group in groups[1:] for s in group):
        tokenizer = load_tokenizer(cfg, (t for text in texts for t in text), tokenizer_dir, family)
    else:
        tokenizer = find_tokenizer(cfg)  # only for its special ids: pre-tokenized data needs no training
    return [encode_rows(cfg, samples, tokenizer, objective) for samples in groups]


def encode_rows(cfg, samples: list[Sample], tokenizer, objective: Objective, always_mask: bool = False) -> TokenDataset:
    """The samples as padded rows with labels for the run's `objective`, one a row, and the facts
    of encoding them; `always_mask`: an attention mask even where nothing is padded (a stream's
    minibatch, whose neighbours may be)."""
    seq_len = cfg.data.seq_len
    texts = [s.text for s in samples if s.input_ids is None]
    encoded = _tokenize(tokenizer, texts, seq_len) if texts else []
    rows_of_text = iter(encoded)
    rows = [s.input_ids[:seq_len] if s.input_ids is not None else next(rows_of_text) for s in samples]
    specials = special_ids(tokenizer)
    ids, attention = pad_rows(rows, seq_len, specials.pad)
    if always_mask and attention is None:
        attention = torch.ones_like(ids)
    class_ids = [s.label for s in samples] if labels.class_labels(objective) else None
    dataset = with_labels(cfg, ids, attention, specials, class_ids, objective)
    cut = sum(len(s.input_ids) > seq_len for s in samples if s.input_ids is not None)
    dataset.facts = {"records": len(samples), "tokens": sum(len(row) for row in rows),
                     "truncated": cut + _cut_texts(tokenizer, texts, encoded, seq_len), "dropped": 0}
    return dataset


def _tokenize(tokenizer, texts: list[tuple[str, ...]], seq_len: int) -> list[list[int]]:
    columns = [list(column) for column in zip(*texts, strict=True)]
    return tokenizer(*columns, truncation=True, max_length=seq_len)["input_ids"]


def _cut_texts(tokenizer, texts: list[tuple[str, ...]], encoded: list[list[int]], seq_len: int) -> int:
    """How many texts truncation cut: only those that filled seq_len can have been, so only they
    are encoded again whole."""
    full = [text for text, ids in zip(texts, encoded, strict=True) if len(ids) == seq_len]
    if not full:
        return 0
    columns = [list(column) for column in zip(*full, strict=True)]
    return sum(len(ids) > seq_len for ids in tokenizer(*columns, truncation=False, verbose=False)["input_ids"])


def special_ids(tokenizer) -> SpecialIds:
    """Pad, mask and special ids of `tokenizer`; the synthetic data's ids when there is none."""
    if tokenizer is None:
        return DEFAULT_SPECIAL_IDS
    pad = tokenizer.pad_token_id
    if pad is None:  # GPT-2 checkpoints have no pad token; the mask and -100 labels hide padding anyway
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return SpecialIds(pad=pad, mask=tokenizer.mask_token_id, special=tuple(tokenizer.all_special_ids))


def pad_rows(rows: list[list[int]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, seq_len] ids and the attention mask (1 = real token), None when nothing is padded."""
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    lengths = torch.tensor([min(len(row), seq_len) for row in rows], dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : lengths[i]] = torch.tensor(row[:seq_len], dtype=torch.long)
    attention = (torch.arange(seq_len) < lengths[:, None]).long()
    return ids, None if bool(attention.all()) else attention


def with_labels(cfg, ids, attention, specials: SpecialIds, class_ids: list[int] | None,
                objective: Objective) -> TokenDataset:
    """The dataset with labels for the run's `objective` (masked tokens drawn from data.seed)."""
    if labels.class_labels(objective):
        classes = torch.tensor(class_ids, dtype=torch.long)
        return TokenDataset(input_ids=ids, labels=classes, attention_mask=attention)
    if labels.next_token_labels(objective):
        return TokenDataset(input_ids=ids, labels=causal_labels(ids, attention), attention_mask=attention)
    if specials.mask is None:
        raise ConfigError("model.task=masked_lm needs a tokenizer with a mask token; this one has none")
    masked, masked_labels = mask_tokens(ids, attention, specials, cfg.data.seed)
    return TokenDataset(input_ids=masked, labels=masked_labels, attention_mask=attention)


def causal_labels(ids: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
    """Labels are the inputs (the model shifts them); padding is ignored by position, not by id,
    because GPT-2 pads with its end-of-text token."""
    targets = ids.clone()
    if attention is not None:
        targets[attention == 0] = IGNORE_INDEX
    return targets


def mask_tokens(
    ids: torch.Tensor, attention: torch.Tensor | None, specials: SpecialIds, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM inputs and labels: MLM_MASK_RATE of the real (non-pad, non-special) tokens,
    drawn from `seed`, become the mask id; labels are -100 elsewhere. Every sample predicts at
    least one token, so no micro-batch row has an empty loss."""
    generator = torch.Generator().manual_seed(seed)
    present = torch.ones_like(ids, dtype=torch.bool) if attention is None else attention.bool()
    real = present & ~torch.isin(ids, torch.tensor(specials.special, dtype=torch.long))
    scores = torch.rand(ids.shape, generator=generator)
    chosen = real & (scores < MLM_MASK_RATE)
    # A row with nothing drawn predicts its lowest-scoring real token (any present one if it has none).
    candidates = torch.where(real.any(dim=1, keepdim=True), real, present)
    fallback = torch.where(candidates, scores, torch.inf).argmin(dim=1)
    empty = ~chosen.any(dim=1)
    chosen[empty, fallback[empty]] = True
    targets = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    return torch.where(chosen, torch.full_like(ids, specials.mask), ids), targets
