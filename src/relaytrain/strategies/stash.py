"""Where each block's input waits for its backward (`strategy.stash`): the one rule every strategy
with a stash reads, and the baseline's and FSDP's stash on the host.

L2L's relay keeps its stash itself (`relay.ActivationStash`, walked by `l2l.py`). The baseline and
FSDP with `strategy.recompute=block` checkpoint every block (torch's non-reentrant checkpoint), so
what a block keeps for its backward is its input alone. With `strategy.stash=host` that input
leaves the device once the block's forward is done (downloaded to pinned host memory on the
offload stream) and comes back before the block is recomputed, uploaded while the block above it
recomputes and backpropagates (the next entry is prefetched as each is taken): the device holds
the entries in transit, not one per block. The values are the same, so are the weights.

How the input travels without the checkpoint holding it: the checkpointed function reads the
input from a `StashedInput` rather than taking it as an argument (torch's checkpoint keeps its
arguments for the recompute). In the forward it holds the device tensor, which the layer's graph
records as its input as usual (so the gradient reaches the block below); afterwards it holds only
the host copy, which the recompute uploads as a fresh leaf of the same shape and `requires_grad`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from relaytrain.schema.config import Choice
from relaytrain.strategies.relay import ActivationStash
from relaytrain.strategies.transfers import Transfers


class Stash(Choice):
    """Where each block's input waits for the backward (`strategy.stash`); `host` is host memory,
    as in `strategy.offload=host` (`config.Offload`)."""

    device = "device"
    host = "host"


def stash_on_host(s) -> bool:
    """Where the block inputs wait (`s`: the strategy section): the one rule the run, its
    estimates and its cost model read. A section without the key (a strategy without a stash, a
    config written before it had one) keeps them on the device."""
    return getattr(s, "stash", Stash.device) == Stash.host


class HostStash:
    """One micro-batch's blocks, each checkpointed with its input waiting on the host; torch's
    checkpoint takes `context_fn` (what to enter around the forward and the recompute)."""

    def __init__(self, transfers: Transfers, context_fn=noop_context_fn):
        self.entries = ActivationStash(transfers, on_host=True)
        self.context_fn = context_fn

    def checkpoint(self, block: nn.Module, index: int, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        """`block(hidden, ctx)`, recomputed in the backward from `hidden`'s host copy (block `index`)."""
        stashed = StashedInput(self.entries, index, hidden)
        out = checkpoint(stashed.run, block, ctx, use_reentrant=False, context_fn=self.context_fn)
        stashed.leave()
        return out


class StashedInput:
    """A block's input: on the device for its forward, then on the host until its recompute."""

    def __init__(self, entries: ActivationStash, index: int, hidden: torch.Tensor):
        self.entries, self.index = entries, index
        self.hidden: torch.Tensor | None = hidden
        self.requires_grad = hidden.requires_grad

    def leave(self) -> None:
        """The forward is done: the device copy goes to the host."""
        self.entries.put((self.index, 0), self.hidden)
        self.hidden = None

    def run(self, block: nn.Module, ctx: dict) -> torch.Tensor:
        if self.hidden is not None:  # the forward: the graph starts at the block below's output
            return block(self.hidden, ctx)
        # The recompute, in the backward: blocks run top down, so block index - 1 is next.
        below = (self.index - 1, 0) if self.index > 0 else None
        x = self.entries.take((self.index, 0), below).detach().requires_grad_(self.requires_grad)
        return block(x, ctx)
