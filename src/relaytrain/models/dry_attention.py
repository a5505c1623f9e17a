"""Attention for a dry run on the meta device, with a GPU's memory footprint.

On the meta device PyTorch's `scaled_dot_product_attention` falls back to its math path,
which materialises the s x s attention probabilities and keeps them for backward; a GPU (and
the CPU) runs a fused kernel that keeps only the output and the log-sum-exp. So a dry run
computes attention with the memory-efficient kernel's own operator, whose meta kernel
allocates exactly what the GPU's does, registered with Hugging Face as the attention
implementation `relaytrain_dry_run` (masks made as for sdpa). Only `build_model` on the meta
device uses it.

Grouped-query attention (fewer key/value heads than query heads) repeats the key and value
heads to the query's count first, as Hugging Face's sdpa path does whenever it cannot hand
the grouping to the kernel: the memory-efficient kernel takes equal head counts only (its
backward returns gradients of the query's width), and the repeated copies are what it keeps.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from relaytrain.dryrun import meta_autocast

NAME = "relaytrain_dry_run"


def efficient_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, **kwargs):
    """Hugging Face's attention-function contract: (batch, seq, heads, dim) output, no weights."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # grouped-query attention: n_rep = 1 is a no-op
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    bias = None
    if attention_mask is not None:
        bias = attention_mask
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(~bias, float("-inf"))
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    # Under amp_* autocast casts sdpa's operands; torch.ops is past any mode that could see this call.
    query, key, value, bias = meta_autocast.operands("scaled_dot_product_attention", query, key, value, bias)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p=dropout, is_causal=causal, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, efficient_attention)
def padded_mask(*args, attention_mask=None, **kwargs):
    """sdpa's mask, except that a micro-batch with a padding mask is taken as padded: Hugging Face
    skips the mask only when every token is real, a check that reads values, which the meta device
    has none of. A GPU then builds the mask, and so does the dry run."""
    if attention_mask is not None:
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionMaskInterface.register(NAME, padded_mask)
