"""What a pipeline stage holds between the actions of its program: one place for all of it.

The instruction handlers (`handlers.py`) keep nothing themselves; whatever one action leaves
for a later one (a stashed activation, a received gradient, a reduction still summing) is an
entry here, and each entry's convention says who puts it and who takes it.

Keys: a *unit* is (chunk, global micro-batch id k), as `schedule.Action.unit`; a *batch* is
b = k // m, the weight update it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relaytrain.models.layered import MicroBatch
from relaytrain.objectives.base import Divisor
from relaytrain.strategies.pipeline.comms import GradReduction, TiedExchange
from relaytrain.strategies.pipeline.routing import UnitRouting
from relaytrain.strategies.pipeline.schedule import Op


@dataclass
class InFlight:
    """A stage's in-flight work, keyed as the module docstring says.

    - `lrs`: batch -> the learning rate `step` was given for it; popped when its update applies.
    - `minibatches`: batch -> (this replica's micro-batches of it, what their losses are divided
      by on the last stage: `Divisor`); put by `step`, kept two batches (2BW overlaps them).
    - `stash`: unit -> (its input: the received activation, None on the embedding chunk; its
      output: the hidden state sent on, or the loss); put by the forward, read by SEND_ACT,
      popped by the backward.
    - `inbox`: (RECV_ACT or RECV_GRAD, unit) -> the received tensor; popped by the compute
      that uses it.
    - `tied_recvs`: batch -> the receives of the partner stage's tied gradients, shaped like
      the batch's version's tied weights; posted at the stage's last backward of the batch
      (the gradients may come during it), popped by REDUCE_GRADS.
    - `grads_out`: unit -> the gradient of its input (with its routing message, `routing.Framing`),
      from the backward until SEND_GRAD.
    - `routing`: unit -> its `routing.UnitRouting` (a mixture's balancing loss); put by the
      forward, read by SEND_ACT, popped by the backward.
    - `routing_inbox`: (RECV_ACT or RECV_GRAD, unit) -> the routing message that came with the
      received tensor; popped by the compute that uses it.
    - `batch_loss`: batch -> the sum of its micro-batches' losses (last stage); popped when
      `step` returns the batch's loss.
    - `reductions`: batch -> its gradients summing over replicas and tied copies; put by
      REDUCE_GRADS, popped when the update applies (in batch order).
    """

    lrs: dict[int, float] = field(default_factory=dict)
    minibatches: dict[int, tuple[list[MicroBatch], Divisor]] = field(default_factory=dict)
    stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    inbox: dict[tuple[Op, tuple[int, int]], torch.Tensor] = field(default_factory=dict)
    tied_recvs: dict[int, TiedExchange] = field(default_factory=dict)
    grads_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    routing: dict[tuple[int, int], UnitRouting] = field(default_factory=dict)
    routing_inbox: dict[tuple[Op, tuple[int, int]], torch.Tensor] = field(default_factory=dict)
    batch_loss: dict[int, torch.Tensor] = field(default_factory=dict)
    reductions: dict[int, GradReduction] = field(default_factory=dict)

    def keep(self, batch: int, rows: list[MicroBatch], divisor: Divisor) -> None:
        """Batch `batch`'s micro-batches and their losses' divisor; the one two batches back is done with."""
        self.minibatches.pop(batch - 2, None)
        self.minibatches[batch] = (rows, divisor)

    def microbatch(self, k: int, m: int, device: torch.device) -> tuple[MicroBatch, Divisor]:
        """Global micro-batch k on the device, and its batch's divisor."""
        rows, divisor = self.minibatches[k // m]
        return rows[k % m].to(device, non_blocking=True), divisor

    def stashed(self) -> list[torch.Tensor]:
        """Every tensor the stash holds (memory accounting)."""
        return [t for pair in self.stash.values() for t in pair]

    def reduced(self) -> list[torch.Tensor]:
        """Every gradient sum still held by a reduction (memory accounting)."""
        return [g for r in self.reductions.values() for g in r.tensors()]
