"""One pipeline worker: executes its stage's program through a dispatch table.

Each action type maps to one method (DeepSpeed's engine does the same with its
instructions), so the order of work lives entirely in the schedule; this file only knows
how to do each kind of work.
"""

from __future__ import annotations

import bisect
import copy
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from relaytrain import metrics
from relaytrain.checkpoint import checkpoint_dir
from relaytrain.data.dataset import MicroBatchLoader, TokenDataset
from relaytrain.models import build_model
from relaytrain.models.layered import MicroBatch
from relaytrain.optim import build_optimizer, lr_at, set_lr
from relaytrain.precision import Precision
from relaytrain.report import StepProgress
from relaytrain.strategies.base import minibatch_items
from relaytrain.strategies.pipeline import checkpoints
from relaytrain.strategies.pipeline.comms import Comms, GradReduction, StopVotes, TiedExchange, Topology
from relaytrain.strategies.pipeline.schedule import (
    Action,
    Op,
    build_schedule,
    stop_points,
    stop_vote_lag,
    weight_version,
)
from relaytrain.strategies.pipeline.stage import StageModule, partition
from relaytrain.train import TrainingDiverged

RECEIVE = (Op.RECV_ACT, Op.RECV_GRAD)
RECVS_AHEAD = 1  # receives posted ahead of their action, per direction (gloo; see Comms.async_p2p)


@dataclass(frozen=True)
class Stopped:
    """The ranks agreed to stop on `signum` after `step` steps and saved the checkpoint at `path`."""

    signum: int
    step: int
    path: Path


class WeightVersions:
    """The stage's weights: one buffer (flush) or two (2BW), version v living in buffer v % 2.

    2BW's update W(b+1) = W(b) - lr * grad(W(b-1)) goes into the buffer that held W(b-1):
    batch b, its only user, is finished by then, while W(b) must stay untouched for the
    in-flight micro-batches of batch b+1. The optimizer follows the newest buffer, its state
    re-keyed to that buffer's parameters, so two versions plus one optimizer state is all a
    stage keeps.
    """

    def __init__(self, stage: StageModule, double_buffered: bool, optim_cfg):
        self.buffers = [stage] + ([copy.deepcopy(stage)] if double_buffered else [])
        # Tied weights last: GradReduction sums them over a different group.
        self.names = [n for n, _ in stage.named_parameters() if n not in stage.tied_names] + stage.tied_names
        self.params = [[dict(b.named_parameters())[n] for n in self.names] for b in self.buffers]
        self.optimizer = build_optimizer(zip(self.names, self.params[0], strict=True), optim_cfg)
        self.updates = 0

    def module(self, version: int) -> StageModule:
        return self.buffers[version % len(self.buffers)]

    def latest(self) -> StageModule:
        return self.module(self.updates)

    def take_grads(self, version: int) -> list[torch.Tensor]:
        """Gradients accumulated on `version`'s buffer; the buffer's .grad is cleared for the next batch."""
        grads = []
        for p in self.params[version % len(self.buffers)]:
            grads.append(torch.zeros_like(p) if p.grad is None else p.grad)
            p.grad = None
        return grads

    def apply(self, grads: list[torch.Tensor], lr: float) -> None:
        """One optimizer step: version `updates` becomes version `updates + 1`."""
        target = self.params[(self.updates + 1) % len(self.buffers)]
        if len(self.buffers) == 2:
            source = self.params[self.updates % 2]
            with torch.no_grad():
                torch._foreach_copy_(target, source)
            self._rekey_optimizer(source, target)
        for p, g in zip(target, grads, strict=True):
            p.grad = g
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1

    def state(self) -> dict:
        """The live versions (2BW: the newest and the one the next batch still computes with),
        under the whole model's names, and the optimizer state (by position, as torch keeps it)."""
        live = range(max(self.updates - len(self.buffers) + 1, 0), self.updates + 1)
        return {
            "updates": self.updates,
            "weights": {version: self.module(version).global_state_dict() for version in live},
            "optimizer": self.optimizer.state_dict()["state"],
        }

    def load_state(self, state: dict) -> None:
        for version, weights in state["weights"].items():
            self.module(version).load_global_state_dict(weights)
        self.updates = state["updates"]
        newest = self.params[self.updates % len(self.buffers)]
        if newest is not self.params[0]:  # the optimizer follows the newest buffer
            self._rekey_optimizer(self.params[0], newest)
        # The config's hyperparameters stay; only the per-parameter state comes from the checkpoint.
        state_dict = self.optimizer.state_dict()
        state_dict["state"] = state["optimizer"]
        self.optimizer.load_state_dict(state_dict)

    def _rekey_optimizer(self, source: list[torch.Tensor], target: list[torch.Tensor]) -> None:
        position = {id(p): i for i, p in enumerate(source)}
        for group in self.optimizer.param_groups:
            group["params"] = [target[position[id(p)]] for p in group["params"]]
        self.optimizer.state = defaultdict(
            dict, {target[position[id(p)]]: state for p, state in self.optimizer.state.items()}
        )


def build_stage(cfg, stage: int) -> StageModule:
    """Every worker builds the same seeded model and keeps its own part of it."""
    s = cfg.strategy
    model = build_model(cfg.model, cfg.train.seed)
    blocks = partition(model.num_blocks, s.stages, s.layout)[stage]
    return StageModule(model, blocks, stage == 0, stage == s.stages - 1, s.recompute)


class StageWorker:
    """Runs its stage's program one segment at a time: the batches up to the next checkpoint,
    or fewer when the ranks vote to stop (SIGINT/SIGTERM), then saves its part of the checkpoint.

    `stop_requested()` returns the signal this rank was asked to stop by, 0 if none.
    """

    def __init__(self, cfg, topology: Topology, rank: int, dataset: TokenDataset, device: torch.device,
                 run_dir: Path, stop_requested: Callable[[], int]):
        s = cfg.strategy
        self.cfg, self.device, self.rank = cfg, device, rank
        self.stage, self.replica = topology.position(rank)
        self.first, self.last = self.stage == 0, self.stage == s.stages - 1
        self.m = s.num_microbatches
        self.checkpoints = checkpoint_dir(run_dir)
        self.stop_requested = stop_requested
        self.stopped: Stopped | None = None
        stage = build_stage(cfg, self.stage).to(device)
        # Before Comms: only the end stages create the tied group, and every rank must create
        # the groups it shares in the same order.
        self.votes = StopVotes(topology.world_size, s.timeout_s)
        self.votes_until = 0  # REDUCE_GRADS(b) votes for b < votes_until (the segment's last decisions)
        self.comms = Comms(topology, rank, bool(stage.tied_names), s.timeout_s)
        self.versions = WeightVersions(stage, s.name == "pipe_2bw", cfg.optim)
        self.num_tied = len(stage.tied_names)
        self.precision = Precision.from_name(cfg.precision.name)
        # One loader over the whole (all replicas) minibatch; each replica reads its rows.
        self.loader = MicroBatchLoader(dataset, s.microbatch_size * s.replicas, self.m, cfg.data.shuffle, cfg.data.seed)
        self.rows = slice(self.replica * s.microbatch_size, (self.replica + 1) * s.microbatch_size)
        self.hidden_shape = (s.microbatch_size, dataset.seq_len, cfg.model.hidden_size)
        self.minibatches: dict[int, tuple[list[MicroBatch], int]] = {}
        self.stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # k -> (input, output)
        self.inbox: dict[tuple[Op, int], torch.Tensor] = {}
        self.posted: dict[tuple[Op, int], tuple[dist.Work, torch.Tensor]] = {}  # receives under way
        self.tied_recvs: dict[int, TiedExchange] = {}  # per batch: the partner's tied gradients, posted early
        self.grads_out: dict[int, torch.Tensor] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []  # kept alive until delivered
        self.batch_loss: dict[int, torch.Tensor] = {}
        self.reductions: dict[int, GradReduction] = {}
        self.losses: list[float] = []
        self.earlier_step_times: list[float] = []  # steps before the checkpoint this run resumed from
        self.timer = metrics.PhaseTimer()
        self.paused = 0.0  # seconds spent saving checkpoints: left out of the step times
        self.done_at: list[float] = []  # per batch: seconds since start when its last backward ended here
        self.busy_at: list[float] = []  # per batch: forward+backward seconds spent by then
        self.dispatch = {
            Op.FORWARD: self.forward, Op.BACKWARD: self.backward,
            Op.RECV_ACT: self.recv_act, Op.SEND_ACT: self.send_act,
            Op.RECV_GRAD: self.recv_grad, Op.SEND_GRAD: self.send_grad,
            Op.REDUCE_GRADS: self.reduce_grads, Op.OPTIMIZER_STEP: self.optimizer_step,
        }

    # ------------------------------------------------------------------ the loop
    def run(self, first: int, progress: StepProgress | None) -> dict:
        """Train batches [first, train.steps); sets `stopped` if the ranks agreed to stop early."""
        self.progress = progress
        steps = self.cfg.train.steps
        if self.rank == 0:
            checkpoints.remove_staging(self.checkpoints)  # before the barrier: no rank writes parts yet
        dist.barrier()  # start the clock together
        metrics.synchronize(self.device)
        self.start = time.perf_counter()
        step = first
        while step < steps:
            step, voted = self._run_segment(step, self._segment_end(step))
            self._wait_for_sends()
            signum = self.votes.settle(max(voted, self.stop_requested()))
            if step < steps and (signum or self._checkpoint_due(step)):
                path = self._save(step)
                if signum:
                    self.stopped = Stopped(signum, step, path)
                    break
        metrics.synchronize(self.device)
        return self.report()

    def _segment_end(self, step: int) -> int:
        every = self.cfg.train.checkpoint_every
        return min(self.cfg.train.steps, (step // every + 1) * every) if every else self.cfg.train.steps

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.train.checkpoint_every
        return bool(every) and step % every == 0

    def _run_segment(self, first: int, end: int) -> tuple[int, int]:
        """Run batches [first, end), or [first, c) if the vote read before batch c says stop.

        Returns the batch reached and the signal voted for (0: none). The programs for
        [first, end) and [first, c) agree up to this stage's stop point for c (see
        `schedule.stop_points`), so switching there is exact: the stage finishes what it began.
        """
        lag = stop_vote_lag(self.cfg.strategy.name)
        program = self._program(first, end)
        points = {i: c for i, c in stop_points(program, self.m).items() if c - lag >= first}
        self.votes_until = end - lag
        undecided = sorted(points)  # receives are posted ahead only up to the next undecided stop point
        i, voted, ahead = 0, 0, 0
        while i < len(program):
            if i in points and not voted:
                with self.timer.phase("wait"):
                    voted = self.votes.result(points[i] - lag)
                if voted:
                    end = points[i]
                    program = self._program(first, end)
                    undecided = []
                    continue  # with the shorter program, which may end right here
            if self.comms.async_p2p:
                nxt = bisect.bisect_right(undecided, i)
                horizon = undecided[nxt] if nxt < len(undecided) else len(program)
                ahead = self._post_receives(program, max(ahead, i), horizon)
            self.dispatch[program[i].op](program[i])
            i += 1
        return end, voted

    def _post_receives(self, program: list[Action], start: int, horizon: int) -> int:
        """Post the receives of program[start:horizon] in program order (each peer sends in that
        order), at most RECVS_AHEAD per direction outstanding, so the data arrives while this
        stage computes instead of after it asks. Returns the index up to which all are posted.

        Never past `horizon`, the next stop point not yet decided: a stop there would leave a
        receive posted for a transfer that never comes. Up to it, the stopped program equals this one.
        """
        i = start
        while i < horizon:
            a = program[i]
            if a.op in RECEIVE and (a.op, a.microbatch) not in self.posted:
                if sum(1 for op, _ in self.posted if op is a.op) >= RECVS_AHEAD:
                    break
                self.posted[(a.op, a.microbatch)] = self._post_recv(a)
            i += 1
        return i

    def _program(self, first: int, end: int) -> list[Action]:
        s = self.cfg.strategy
        return build_schedule(s.name, s.stages, self.m, end, first).actions(self.stage)

    def _wait_for_sends(self) -> None:
        for work, _ in self.sends:
            work.wait(self.comms.timeout)
        self.sends = []

    # ------------------------------------------------------------------ checkpoints
    def _save(self, step: int) -> Path:
        began = time.perf_counter()
        if self.replica == 0:  # replicas hold bit-identical weights, optimizer state and RNG streams
            checkpoints.write_part(self.checkpoints, step, self.stage, self.capture(step))
        dist.barrier()  # every stage's part is on disk
        if self.rank == 0:
            checkpoints.publish(self.checkpoints, step, checkpoints.manifest(self.cfg, step),
                                self.cfg.train.keep_checkpoints)
        dist.barrier()  # and the checkpoint is complete before any rank may report it
        self.paused += time.perf_counter() - began
        return checkpoints.step_dir(self.checkpoints, step)

    def capture(self, step: int) -> dict:
        """Everything this stage's next step depends on. The data position is the step itself:
        every worker reads minibatch b of the deterministic loader for batch b."""
        return {
            "format": checkpoints.FORMAT,
            "step": step,
            "stage": self.stage,
            **self.versions.state(),
            "rng": checkpoints.rng_state(self.device),
            "history": {"losses": self.losses, "step_times": self.step_times()} if self.last else None,
        }

    def restore(self, part: dict) -> int:
        """Continue from a checkpoint part (built like a fresh worker first); return its step."""
        self.versions.load_state(part)
        checkpoints.set_rng_state(part["rng"], self.device)
        if self.last:
            self.losses = list(part["history"]["losses"])
            self.earlier_step_times = list(part["history"]["step_times"])
        return part["step"]

    # ------------------------------------------------------------------ compute
    def forward(self, a: Action) -> None:
        mb, items = self._microbatch(a.microbatch)
        hidden = None if self.first else self.inbox.pop((Op.RECV_ACT, a.microbatch))
        with self.timer.phase("forward"), self.precision.autocast_context(self.device):
            out = self.versions.module(a.version)(mb, hidden, items)
        self.stash[a.microbatch] = (hidden, out)
        if self.last:
            self.batch_loss[a.batch] = self.batch_loss.get(a.batch, 0.0) + out.detach()

    def backward(self, a: Action) -> None:
        hidden, out = self.stash.pop(a.microbatch)
        if self.comms.tied_peer is not None and a.microbatch % self.m == self.m - 1:
            # This stage's last backward of the batch: the partner's tied gradients may come during it.
            tied = self.versions.params[a.version % len(self.versions.buffers)][len(self.versions.names) - self.num_tied:]
            self.tied_recvs[a.batch] = TiedExchange(self.comms, tied)
        with self.timer.phase("backward"):
            grad = None if self.last else self.inbox.pop((Op.RECV_GRAD, a.microbatch))
            out.backward(grad)
        if not self.first:
            self.grads_out[a.microbatch] = hidden.grad

    # ------------------------------------------------------------------ transfers
    def send_act(self, a: Action) -> None:
        self._send(self.stash[a.microbatch][1].detach().float(), self.comms.next)

    def send_grad(self, a: Action) -> None:
        self._send(self.grads_out.pop(a.microbatch), self.comms.prev)

    def recv_act(self, a: Action) -> None:
        self._recv(a, requires_grad=True)

    def recv_grad(self, a: Action) -> None:
        self._recv(a, requires_grad=False)

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        tensor = tensor.contiguous()
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        self.sends.append((self.comms.send(tensor, to), tensor))

    def _post_recv(self, a: Action) -> tuple[dist.Work, torch.Tensor]:
        buffer = torch.empty(self.hidden_shape, dtype=torch.float32, device=self.device)
        source = self.comms.prev if a.op is Op.RECV_ACT else self.comms.next
        return self.comms.post_recv(buffer, source), buffer

    def _recv(self, a: Action, requires_grad: bool) -> None:
        key = (a.op, a.microbatch)
        work, buffer = self.posted.pop(key) if key in self.posted else self._post_recv(a)
        with self.timer.phase("wait"):
            work.wait(self.comms.timeout)
        self.inbox[key] = buffer.requires_grad_(requires_grad)

    # ------------------------------------------------------------------ updates
    def reduce_grads(self, a: Action) -> None:
        metrics.synchronize(self.device)
        self.done_at.append(time.perf_counter() - self.start - self.paused)
        self.busy_at.append(self.timer.totals.get("forward", 0.0) + self.timer.totals.get("backward", 0.0))
        grads = self.versions.take_grads(weight_version(self.cfg.strategy.name, a.batch * self.m, self.m))
        loss = self.batch_loss.pop(a.batch) if self.last else None
        reduction = GradReduction(self.comms, grads, self.num_tied, loss, self.tied_recvs.pop(a.batch, None))
        self.reductions[a.batch] = reduction
        self.sends.extend(reduction.sends)
        if a.batch < self.votes_until:
            self.votes.cast(a.batch, self.stop_requested())

    def optimizer_step(self, a: Action) -> None:
        with self.timer.phase("wait"):
            loss, grads = self.reductions.pop(a.batch).finish()
        if loss is not None and not math.isfinite(loss):
            # Raised before the update and before this step's checkpoint part: no checkpoint holds it.
            raise TrainingDiverged(
                f"the loss became {loss} at step {a.batch + 1} under precision={self.cfg.precision.name}; "
                f"the last good checkpoint stays in {self.checkpoints}; lower optim.lr or use precision=fp32"
            )
        with self.timer.phase("optimizer"):
            self.versions.apply(grads, lr_at(a.batch, self.cfg.optim, self.cfg.train.steps))
        if loss is not None:
            self.losses.append(loss)
            if self.progress is not None:
                step_time = self.done_at[-1] - (self.done_at[-2] if len(self.done_at) > 1 else 0.0)
                self.progress.update(a.batch + 1, loss, step_time)

    # ------------------------------------------------------------------ data
    def _microbatch(self, k: int) -> tuple[MicroBatch, int]:
        """This replica's rows of micro-batch k, and the loss items of k's whole minibatch."""
        batch = k // self.m
        if batch not in self.minibatches:
            self.minibatches.pop(batch - 2, None)  # 2BW overlaps at most two batches
            full = self.loader.minibatch(batch)
            items = minibatch_items(self.versions.buffers[0].model, full) if self.last else 1
            self.minibatches[batch] = (full, items)
        full, items = self.minibatches[batch]
        mb = full[k % self.m]
        rows = MicroBatch(*(None if t is None else t[self.rows] for t in (mb.input_ids, mb.labels, mb.attention_mask)))
        return rows.to(self.device, non_blocking=True), items

    # ------------------------------------------------------------------ report
    def step_times(self) -> list[float]:
        """Seconds per step, the steps before the resumed checkpoint included; the clock is the
        end of each batch's last backward here."""
        return self.earlier_step_times + [b - a for a, b in zip([0.0, *self.done_at], self.done_at, strict=False)]

    def report(self) -> dict:
        return {
            "rank": self.rank,
            "stage": self.stage,
            "replica": self.replica,
            "done_at": self.done_at,
            "busy_at": self.busy_at,
            "phases_s": dict(self.timer.totals),
            "losses": self.losses if self.last else None,
            "step_times": self.step_times() if self.last else None,
            "parameters": sum(p.numel() for p in self.versions.params[0]),
            "blocks": len(self.versions.buffers[0].model.blocks),
            "host_peak_rss_bytes": metrics.HostMemory().peak_bytes(),
            "device_memory": metrics.device_memory(self.device),
        }
