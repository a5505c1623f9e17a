"""The one comparison every decoder test makes: relaytrain's layered loss and every gradient
against the Hugging Face model's own forward (`model(input_ids, labels=...)`), to float noise."""

from __future__ import annotations

import torch

from relaytrain.models import MicroBatch


def padded_batch(rows: int = 3, length: int = 16, vocab: int = 300, seed: int = 0):
    """Token ids, a mask with one row padded from position 11 on (10 on short rows), and the labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, min(11, length - 2):] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def assert_layered_equals_hf(model, reference, ids, mask, labels, what: str = "") -> None:
    """`model` (layered) and `reference` (a Hugging Face causal LM, possibly the very module the
    layered model wraps) give one loss and one gradient for every parameter of `reference`."""
    params = dict(reference.named_parameters())
    wrapped = dict(model.hf_model.named_parameters())
    ours = model(MicroBatch(ids, labels, mask))
    our_grads = dict(zip(params, torch.autograd.grad(ours, [wrapped[name] for name in params], allow_unused=True),
                         strict=True))
    theirs = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    their_grads = dict(zip(params, torch.autograd.grad(theirs, list(params.values()), allow_unused=True), strict=True))
    torch.testing.assert_close(ours, theirs, msg=f"{what}: loss {ours} != {theirs}")
    for name in params:
        torch.testing.assert_close(our_grads[name], their_grads[name], msg=lambda m, n=name: f"{what}: {n}: {m}")

