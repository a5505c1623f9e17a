"""Sampling on the device from a policy held on the host (L2L's masters), where it fits there.

L2L keeps the model on the host and streams blocks through the device; decoding token by token
from the host copy would run on the host's cores. So, where the whole policy and a micro-batch's
KV cache fit in the device's free memory, each rollout batch copies the policy's weights into a
device copy of the model, samples there, and frees the copy (L2L's training keeps its small
device footprint between batches). The copy's skeleton is made once on the meta device, sharing
no storage with the policy (a deep copy whose tensors are meta stand-ins), so making it costs no
host memory; its floating tensors take `dtype` (a cross-precision run's half dtype: the weights
as its blocks compute with them on the device).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from relaytrain.cost.rollout import cache_bytes


class DeviceCopy:
    """A copy of `policy` made on `device` for the duration of `on_device()`, its weights the policy's."""

    def __init__(self, policy: nn.Module, device: torch.device, dtype: torch.dtype | None = None):
        self.policy, self.device = policy, device
        stand_ins = {id(t): _meta_like(t, dtype) for t in [*policy.parameters(), *policy.buffers()]}
        self.model = copy.deepcopy(policy, memo=stand_ins).requires_grad_(False)

    @property
    def bytes(self) -> int:
        """What the copy holds on the device."""
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])

    @contextlib.contextmanager
    def on_device(self) -> Iterator[nn.Module]:
        """The copy on the device with the policy's current weights; freed on leaving."""
        self.model.to_empty(device=self.device)
        try:
            theirs = _tensors(self.policy)
            with torch.no_grad():
                for name, ours in _tensors(self.model).items():
                    ours.copy_(theirs[name], non_blocking=True)
            yield self.model
        finally:
            self.model.to_empty(device="meta")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def fits(model_bytes: int, cache_bytes: int, device: torch.device, margin: float = 1.2) -> bool:
    """Whether the copy and a micro-batch's KV cache fit in `device`'s free memory, with room."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return (model_bytes + cache_bytes) * margin <= free


def kv_cache_bytes(config, sequences: int, tokens: int, dtype: torch.dtype) -> int:
    """Every layer's keys and values for `sequences` sequences of `tokens` tokens (the cost
    model's closed form, `cost.rollout`, from a Hugging Face config)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return cache_bytes(config.num_hidden_layers, heads, width, sequences, tokens, dtype.itemsize)


def _meta_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    chosen = dtype if dtype is not None and t.is_floating_point() else t.dtype
    meta = torch.empty_like(t, device="meta", dtype=chosen)
    return nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Its parameters and buffers by every name they have: `to_empty` gives a tied weight's
    modules a tensor each, so the copy fills each of them (equal, for sampling)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
