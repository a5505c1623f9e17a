"""Attention for a dry run on the meta device, with a GPU's memory footprint.

On the meta device PyTorch's `scaled_dot_product_attention` falls back to its math path,
which materialises the s x s attention probabilities and keeps them for backward; a GPU (and
the CPU) runs a fused kernel that keeps only the output and the log-sum-exp. So a dry run
computes attention with the memory-efficient kernel's own operator, whose meta kernel
allocates exactly what the GPU's does, registered with Hugging Face as the attention
implementation `relaytrain_dry_run` (masks made as for sdpa). Only `build_model` on the meta
device uses it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "relaytrain_dry_run"


def efficient_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, **kwargs):
    """Hugging Face's attention-function contract: (batch, seq, heads, dim) output, no weights."""
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    bias = None
    if attention_mask is not None:
        bias = attention_mask
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(~bias, float("-inf"))
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p=dropout, is_causal=causal, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, efficient_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
