"""The fingerprint of the frozen base an adapter trains on: a checkpoint holds no base, so a
resume reloads `model.pretrained` and must find the same one, to the last bit.

Every byte of every frozen tensor is hashed (sha256: about 0.2 s for 107 M fp32 values on the
2-core test machine, 0.45 s where fp32 values are hashed as the bf16 they were stored in).
The values are hashed in the checkpoint's own dtype, so a base kept in bf16 (L2L's compact base)
and the same base widened to fp32 (every other strategy) give one fingerprint.

Checkpoints written before this format hold a 16-digit hash of 64 values a tensor
(`sampled_fingerprint`); they are still checked, by that sample (`same_base`).
"""

from __future__ import annotations

import hashlib

import torch

PREFIX = "sha256:"
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}  # numpy has no bf16: hashed as its bits


class BaseFingerprint(str):
    """The fingerprint written in a checkpoint's manifest (a plain string there), carrying the
    older sampled one to check checkpoints written before every byte was hashed."""

    sampled: str = ""


def base_fingerprint(model, checkpoint_dtype: str | None = None) -> BaseFingerprint:
    """sha256 over each frozen tensor's name, shape and every value, in `checkpoint_dtype` where
    that is a half dtype (exact: the values were loaded from it), else as held."""
    digest = hashlib.sha256()
    stored = HALF.get(str(checkpoint_dtype))
    for name, p in _frozen(model):
        digest.update(f"{name}:{tuple(p.shape)}".encode())
        if p.device.type != "meta" and p.numel():
            digest.update(_raw_bytes(p.detach(), stored))
    fingerprint = BaseFingerprint(PREFIX + digest.hexdigest()[:32])
    fingerprint.sampled = sampled_fingerprint(model)
    return fingerprint


def same_base(written: str | None, ours: str) -> bool:
    """Whether a manifest's fingerprint is of this base: the full hash, or an older checkpoint's sample."""
    if written is None or written.startswith(PREFIX):
        return written == ours
    return written == getattr(ours, "sampled", None)


def _frozen(model):
    return [(name, p) for name, p in model.hf_model.named_parameters() if not p.requires_grad]


def _raw_bytes(t: torch.Tensor, stored: torch.dtype | None):
    """The tensor's values as bytes, without a copy where it is already contiguous in its dtype."""
    if stored is not None and t.is_floating_point() and t.dtype != stored:
        t = t.to(stored)
    t = t.contiguous().reshape(-1)
    if t.dtype in BITS:
        t = t.view(BITS[t.dtype])
    return t.numpy()


def sampled_fingerprint(model) -> str:
    """The older format: each frozen tensor's name, shape and 64 values spread over it."""
    digest = hashlib.sha256()
    for name, p in _frozen(model):
        digest.update(f"{name}:{tuple(p.shape)}".encode())
        if p.device.type != "meta" and p.numel():
            flat = p.detach().reshape(-1)
            count = min(64, flat.numel())
            picks = torch.arange(count) * (flat.numel() - 1) // max(count - 1, 1)  # integers: exact at any size
            digest.update(flat[picks].float().numpy().tobytes())
    return digest.hexdigest()[:16]
