"""Flat storage for the eager param server: one contiguous buffer per part and kind of tensor.

A part's fp32 masters live in one buffer (`flatten`: each parameter's `.data` becomes a view
into it), and its optimizer's state in one buffer per kind (`FlatState`: Adam's moments,
SGD's momentum), both in param-group order. The update rules read and write the same values
in the same shapes as before; only the storage is shared, so every number is unchanged. What
the layout buys: one allocation per part and kind instead of one per tensor, and a part that
crosses between replicas as one tensor (`strategies.eps.Peers`).

Gradients are not gathered into a flat buffer: on the CPU they are autograd's own tensors,
handed to the EPS without a copy, and gathering them would add a pass over every gradient
that costs more than a flat update saves (docs/l2l.md, "Flat buffers").
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


@torch.no_grad()
def flatten(params: list[nn.Parameter], pin: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One buffer holding `params` in order; each one's `.data` becomes a view into it, and its
    old storage is freed. `pin`: page-locked, for asynchronous copies to a CUDA device. `dtype`:
    the buffer's (the parameters are cast into it); None: the first parameter's."""
    first = params[0]
    buffer = torch.empty(sum(p.numel() for p in params), dtype=dtype or first.dtype, device=first.device,
                         pin_memory=pin)
    for p, piece in zip(params, buffer.split([p.numel() for p in params]), strict=True):
        p.data = piece.view_as(p).copy_(p.data)
    return buffer


class FlatState:
    """Mixin for a `torch.optim.Optimizer`: every state tensor shaped like its parameter is a
    view into one buffer per state key (`exp_avg`, `momentum_buffer`, ...), laid out like the
    parameters in param-group order. Scalars (Adam's step counts) stay as torch makes them.

    A subclass makes new state with `_zeros` (what `torch.zeros_like` would give), or lets
    torch make it and moves it in with `_adopt`; `load_state_dict` moves loaded state in. The
    parameter groups are the ones given at construction.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        params = [p for group in self.param_groups for p in group["params"]]
        starts = itertools.accumulate((p.numel() for p in params[:-1]), initial=0)
        self._start = dict(zip(params, starts, strict=True))  # parameter -> its offset in every buffer
        self._numel = sum(p.numel() for p in params)
        self._buffers: dict[str, torch.Tensor] = {}  # state key -> its buffer

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the state it kept (the loaded tensors, or copies) moves into the buffers."""
        super().load_state_dict(state_dict)
        self._adopt(self._start)

    def _zeros(self, key: str, p: torch.Tensor) -> torch.Tensor:
        """New state `key` of `p`, zero as `torch.zeros_like(p)`, in the key's buffer."""
        return self._view(key, p, p).zero_()

    @torch.no_grad()
    def _adopt(self, params) -> None:
        """Move the state tensors of `params` that torch made or loaded into the buffers."""
        for p in params:
            state = self.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    state[key] = self._view(key, p, value).copy_(value)

    def _view(self, key: str, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`p`'s piece of the buffer of `key` (made at its first use, in `like`'s dtype and device:
        as with torch's own state, an optimizer that never steps holds none)."""
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(self._numel, dtype=like.dtype, device=like.device)
        start = self._start[p]
        return buffer[start:start + p.numel()].view_as(p)


class KeptTensors:
    """fp32 host tensors lent and given back, kept from step to step: the eager param server's
    gradients of half-precision parts (their fp32 `.grad`s) and bf16 masters' fp32 copies
    (`step.rounding.Bf16Masters`).

    A new tensor of a block's size every step is new pages from the OS (glibc keeps freed memory
    only under 32 MiB, `run.launch.keep_freed_host_memory`), which the kernel zeroes at their
    first touch: for a gradient's conversion from bf16 that cost 4x the conversion itself (54
    against 13 ms for 60 M parameters on the 2-core VM; more than the AdamW step of the same
    parameters, 47 ms), on the worker whose time is the step's exposed update. A tensor given
    back is lent again to the next request of its shape, so the pool holds no more than the
    most tensors ever out at once.
    """

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: set[int] = set()  # id() of the tensors out on loan

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """An fp32 tensor of `like`'s shape and device, contents undefined."""
        free = self._free.get((like.shape, like.device))
        tensor = free.pop() if free else torch.empty(like.shape, dtype=torch.float32, device=like.device)
        self._lent.add(id(tensor))
        return tensor

    def give_back(self, tensors: list[torch.Tensor | None]) -> None:
        """Those of `tensors` this pool lent are free again (the caller no longer reads them)."""
        for t in tensors:
            if t is not None and id(t) in self._lent:
                self._lent.discard(id(t))
                self._free.setdefault((t.shape, t.device), []).append(t)
