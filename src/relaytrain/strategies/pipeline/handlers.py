"""The pipeline's instruction handlers: one function per `schedule.Op`, DeepSpeed-style.

`HANDLERS[action.op](stage, action)` does one action of a stage's program; the order of the
actions is the schedule's and the executor's (`executor.py`), the weights are the weight
versions' (`weights.py`, `offload.py`), and whatever an action leaves for a later one is in
`stage.inflight` (`inflight.py`, whose docstring gives each entry's convention). The handlers
keep nothing themselves. Facts the schedule or the versions know are asked of them by name:
which unit is this stage's last backward of a batch (`Schedule.last_backward`), which tensors
a version's tied weights are (`VersionBuffers.tied`), which version a batch's gradients are on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Protocol

import torch

from relaytrain.step.metrics import PhaseTimer
from relaytrain.step.precision import Precision
from relaytrain.strategies.pipeline.comms import TIED_TAG, Comms, GradReduction, Mailbox, Outbox, TiedExchange
from relaytrain.strategies.pipeline.inflight import InFlight
from relaytrain.strategies.pipeline.jitter import StageJitter
from relaytrain.strategies.pipeline.routing import Framing
from relaytrain.strategies.pipeline.schedule import Action, Op, Schedule
from relaytrain.strategies.pipeline.weights import VersionBuffers


class Stage(Protocol):
    """What the handlers need of the stage they act for (`runtime.PipelineStrategy`)."""

    m: int  # micro-batches per update
    schedule: type[Schedule]
    versions: VersionBuffers
    inflight: InFlight
    comms: Comms
    mailbox: Mailbox
    outbox: Outbox
    timer: PhaseTimer
    precision: Precision
    device: torch.device
    jitter: StageJitter | None  # this stage's injected delay, if any
    framing: Framing  # the messages' layout: a mixture's routing rides with them

    def progress(self, text: str) -> None: ...


# -- compute ----------------------------------------------------------------------------------
def forward(stage: Stage, a: Action) -> None:
    state = stage.inflight
    mb, divisor = state.microbatch(a.microbatch, stage.m, stage.device)
    module = stage.versions.module(a.version)
    hidden = None if module.embeds(a.chunk) else state.inbox.pop((Op.RECV_ACT, a.unit))
    routing = stage.framing.unit(a.chunk, state.routing_inbox.pop((Op.RECV_ACT, a.unit), None))
    with stage.timer.phase("update_wait"):  # offload: the update that made this version must have landed
        stage.versions.await_version(a.version)
    with stage.timer.phase("forward"), _jittered(stage, "forward", a), stage.precision.autocast_context(stage.device):
        out = module(mb, hidden, divisor, a.chunk, routing)
    state.stash[a.unit] = (hidden, out)
    if routing is not None:
        state.routing[a.unit] = routing
    if module.computes_loss(a.chunk):
        state.batch_loss[a.batch] = state.batch_loss.get(a.batch, 0.0) + out.detach()


def backward(stage: Stage, a: Action) -> None:
    state = stage.inflight
    hidden, out = state.stash.pop(a.unit)
    module = stage.versions.module(a.version)
    if stage.comms.tied_peer is not None and a.unit == stage.schedule.last_backward(a.batch, stage.m):
        # The partner's tied gradients may come during this stage's last backward of the batch.
        state.tied_recvs[a.batch] = TiedExchange(stage.comms, stage.versions.tied(a.version))
    routing = state.routing.pop(a.unit, None)
    with stage.timer.phase("backward"), _jittered(stage, "backward", a):
        grad = None if module.computes_loss(a.chunk) else state.inbox.pop((Op.RECV_GRAD, a.unit))
        if grad is not None and routing is not None:  # the fractions and loss scale, before any block's share
            routing.settle(state.routing_inbox.pop((Op.RECV_GRAD, a.unit)))
        out.backward(grad)
    if not module.embeds(a.chunk):
        back = routing.backward_message(hidden.device) if routing is not None else None
        state.grads_out[a.unit] = stage.framing.join(hidden.grad, back)
    if module.computes_loss(a.chunk):
        stage.progress(f"micro-batch {a.microbatch % stage.m + 1}/{stage.m} through the pipeline")


def _jittered(stage: Stage, op: str, a: Action):
    """The injected delay of this stage, if RELAYTRAIN_STAGE_JITTER names it (a benchmarking aid)."""
    return stage.jitter.around(op, a.microbatch, stage.device) if stage.jitter is not None else nullcontext()


# -- transfers ----------------------------------------------------------------------------------
def send_act(stage: Stage, a: Action) -> None:
    out = stage.inflight.stash[a.unit][1].detach().float()
    routing = stage.inflight.routing.get(a.unit)
    _send(stage, stage.framing.join(out, routing.forward_message(out.device) if routing is not None else None), a)


def send_grad(stage: Stage, a: Action) -> None:
    _send(stage, stage.inflight.grads_out.pop(a.unit), a)


def recv_act(stage: Stage, a: Action) -> None:
    _recv(stage, a, requires_grad=True)


def recv_grad(stage: Stage, a: Action) -> None:
    _recv(stage, a, requires_grad=False)


def _send(stage: Stage, tensor: torch.Tensor, a: Action) -> None:
    to, group, tag = stage.comms.route(a)
    stage.outbox.send(tensor, to, tag=tag, group=group)


def _recv(stage: Stage, a: Action, requires_grad: bool) -> None:
    with stage.timer.phase("message_wait"):
        buffer = stage.mailbox.take(a)
    tensor, routing = stage.framing.split(buffer)
    stage.inflight.inbox[(a.op, a.unit)] = tensor.requires_grad_(requires_grad)
    if routing is not None:
        stage.inflight.routing_inbox[(a.op, a.unit)] = routing


# -- updates ------------------------------------------------------------------------------------
def reduce_grads(stage: Stage, a: Action) -> None:
    state = stage.inflight
    grads = stage.versions.take_grads(stage.schedule.weight_version(a.batch * stage.m, stage.m))
    reduction = GradReduction(stage.comms, grads, stage.versions.num_tied, state.tied_recvs.pop(a.batch, None))
    state.reductions[a.batch] = reduction
    for work, tensor in reduction.sends:
        stage.outbox.keep(work, tensor, stage.comms.tied_peer, TIED_TAG)


def optimizer_step(stage: Stage, a: Action) -> None:
    """The schedule's deadline for batch a.batch's update: apply it now unless it already was."""
    if a.batch in stage.inflight.reductions:
        _apply_update(stage, a.batch)


def apply_ready_updates(stage: Stage) -> None:
    """Apply each reduced update as soon as its sums have arrived (the paper's 2BW: the
    gradients of batch b are freed before batch b+1's accumulate), in batch order. The
    buffer an update writes held version b-1, which nothing needs once batch b's
    backwards are done here, so an early update never breaks the version rule."""
    reductions = stage.inflight.reductions
    while reductions:
        batch = min(reductions)
        if not reductions[batch].ready():
            return
        _apply_update(stage, batch)


def _apply_update(stage: Stage, batch: int) -> None:
    with stage.timer.phase("reduction_wait"):
        grads = stage.inflight.reductions.pop(batch).finish()
    with stage.timer.phase("optimizer"):  # offload: only starting the update; it lands in the background
        stage.versions.apply(grads, stage.inflight.lrs.pop(batch))


HANDLERS: dict[Op, Callable[[Stage, Action], None]] = {
    Op.FORWARD: forward, Op.BACKWARD: backward,
    Op.RECV_ACT: recv_act, Op.SEND_ACT: send_act,
    Op.RECV_GRAD: recv_grad, Op.SEND_GRAD: send_grad,
    Op.REDUCE_GRADS: reduce_grads, Op.OPTIMIZER_STEP: optimizer_step,
}
