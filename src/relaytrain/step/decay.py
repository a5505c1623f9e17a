"""Which parameters weight decay reaches: one rule for every optimizer (AdamW, LAMB's trust ratio,
Muon's AdamW part)."""

from __future__ import annotations

import torch


def decays(name: str, p: torch.Tensor) -> bool:
    """Matrices and embeddings are decayed (and LAMB-adapted); biases and norm weights are not,
    nor GPT-OSS's per-head attention sinks (1-D), and a bias is one by its name whatever its shape
    (GPT-OSS's experts' `gate_up_proj_bias`, a row of biases per expert), as Hugging Face's Trainer
    exempts every parameter named a bias."""
    return p.ndim >= 2 and not name.endswith("bias")
