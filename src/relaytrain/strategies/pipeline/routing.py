"""A mixture's router balancing loss across a pipeline's stages (issue 38), exact.

Hugging Face's load-balancing term of a micro-batch multiplies the routing fractions f of every
routed layer, which a pipeline's stages hold apart. f carries no gradient, so each block's share
of the term is local once f is known (`models/moe.py`): the routing sums of a micro-batch's
blocks travel forward with its activations (each stage adds its own), the last stage computes f
and the term, and f and the loss's scale travel back with the gradients, so every stage's blocks
add their own share in their backward, as one process would.

The two messages ride on the activation and gradient messages: a flat buffer holding the hidden
state (or its gradient), then the routing's message (`Framing`). A unit's routing on this stage
is one `UnitRouting`, handed to the chunk's forward, which gives it the tally its shared context
made; it keeps what came from upstream and what came back, so a tally made again by a recompute
(`strategy.recompute=stage`, inside the backward) starts as the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaytrain.models.moe import RouterTally, Routing
from relaytrain.strategies.pipeline.schedule import Op


def balancing(model) -> Routing | None:
    """The routing whose balancing loss a stage of `model` carries (None: a dense model, or a
    mixture with `output_router_logits` off)."""
    routing = getattr(model, "routing", None)
    return routing if routing is not None and routing.balances else None


class UnitRouting:
    """One unit's (chunk, micro-batch's) routing on this stage: the sums from the stages before
    (`upstream`), the fractions and loss scale from the stage after (`downstream`), and the tally
    the chunk's blocks record into."""

    def __init__(self, upstream: torch.Tensor | None, upstream_layers: int):
        self.upstream, self.upstream_layers = upstream, upstream_layers
        self.downstream: torch.Tensor | None = None
        self.tally: RouterTally | None = None

    def adopt(self, tally: RouterTally) -> None:
        """The tally the chunk's shared context made, on its forward and again on a recompute. The
        first is the unit's: a recompute only refills the saved tensors of the first forward's
        graph, whose autograd functions (the blocks' shares, the head's term) keep the first tally;
        a recompute's is given the same messages, so that its forward computes as the first did."""
        if self.upstream is not None:
            tally.take_forward_message(self.upstream, self.upstream_layers)
        if self.downstream is not None:
            tally.take_backward_message(self.downstream)
        if self.tally is None:
            self.tally = tally

    def settle(self, downstream: torch.Tensor) -> None:
        """The stage after's fractions and loss scale, before this unit's backward."""
        self.downstream = downstream
        if self.tally is not None:
            self.tally.take_backward_message(downstream)

    def forward_message(self, device: torch.device) -> torch.Tensor:
        return self.tally.forward_message(device)

    def backward_message(self, device: torch.device) -> torch.Tensor:
        return self.tally.backward_message(device)


@dataclass(frozen=True)
class Framing:
    """How a stage's activation and gradient messages are laid out: the hidden state as it is, or,
    while the routers balance, flat and followed by the routing's message (one message, so the
    two can never arrive apart; the price is a copy of the hidden state into it)."""

    shape: tuple[int, ...]  # the hidden state's (micro-batch rows, sequence, hidden)
    experts: int = 0  # 0: no routing rides along
    routed_before: tuple[int, ...] = ()  # per chunk of this stage: the model's routed layers before it

    @classmethod
    def of(cls, shape: tuple[int, ...], model, chunks: list[range]) -> Framing:
        """The layout for a stage holding `chunks` of `model` (asked before the stage drops the
        other stages' blocks)."""
        routing = balancing(model)
        if routing is None:
            return cls(tuple(shape))
        routed = [getattr(block, "router_path", None) is not None for block in model.blocks]
        return cls(tuple(shape), routing.experts, tuple(sum(routed[:chunk.start]) for chunk in chunks))

    @property
    def routes(self) -> bool:
        return self.experts > 0

    def unit(self, chunk: int, upstream: torch.Tensor | None) -> UnitRouting | None:
        """A new unit's routing on chunk `chunk` (None: nothing rides along)."""
        return UnitRouting(upstream, self.routed_before[chunk]) if self.routes else None

    def extra(self, op: Op) -> int:
        """The routing message's length: [counts, probability sums] forward, [fractions, loss
        scale] back (`RouterTally.forward_message`, `backward_message`)."""
        return 2 * self.experts if op in (Op.RECV_ACT, Op.SEND_ACT) else self.experts + 1

    def buffer_shape(self, op: Op) -> tuple[int, ...]:
        if not self.routes:
            return self.shape
        return (torch.Size(self.shape).numel() + self.extra(op),)

    def join(self, tensor: torch.Tensor, routing: torch.Tensor | None) -> torch.Tensor:
        if not self.routes:
            return tensor
        return torch.cat([tensor.reshape(-1), routing.to(tensor.dtype)])

    def split(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the hidden state or its gradient, a view of the buffer; the routing message or None)."""
        if not self.routes:
            return buffer, None
        n = torch.Size(self.shape).numel()
        return buffer[:n].view(self.shape), buffer[n:]
