"""One pipeline worker: executes its stage's program through a dispatch table.

Each action type maps to one method (DeepSpeed's engine does the same with its
instructions), so the order of work lives entirely in the schedule; this file only knows
how to do each kind of work.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from relaytrain import metrics
from relaytrain.data.dataset import MicroBatchLoader, TokenDataset
from relaytrain.models import build_model
from relaytrain.models.layered import MicroBatch
from relaytrain.optim import build_optimizer, lr_at, set_lr
from relaytrain.precision import Precision
from relaytrain.report import StepProgress
from relaytrain.strategies.base import minibatch_items
from relaytrain.strategies.pipeline.comms import Comms, GradReduction, Topology
from relaytrain.strategies.pipeline.schedule import Action, Op, weight_version
from relaytrain.strategies.pipeline.stage import StageModule, partition


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
    def __init__(self, cfg, topology: Topology, rank: int, dataset: TokenDataset, device: torch.device):
        s = cfg.strategy
        self.cfg, self.device, self.rank = cfg, device, rank
        self.stage, self.replica = topology.position(rank)
        self.first, self.last = self.stage == 0, self.stage == s.stages - 1
        self.m = s.num_microbatches
        stage = build_stage(cfg, self.stage).to(device)
        self.comms = Comms(topology, rank, bool(stage.tied_names), s.timeout_s)
        self.versions = WeightVersions(stage, s.name == "pipe_2bw", cfg.optim)
        self.precision = Precision.from_name(cfg.precision.name)
        # One loader over the whole (all replicas) minibatch; each replica reads its rows.
        self.loader = MicroBatchLoader(dataset, s.microbatch_size * s.replicas, self.m, cfg.data.shuffle, cfg.data.seed)
        self.rows = slice(self.replica * s.microbatch_size, (self.replica + 1) * s.microbatch_size)
        self.hidden_shape = (s.microbatch_size, dataset.seq_len, cfg.model.hidden_size)
        self.minibatches: dict[int, tuple[list[MicroBatch], int]] = {}
        self.stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # k -> (input, output)
        self.inbox: dict[tuple[Op, int], torch.Tensor] = {}
        self.grads_out: dict[int, torch.Tensor] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []  # kept alive until delivered
        self.batch_loss: dict[int, torch.Tensor] = {}
        self.reductions: dict[int, GradReduction] = {}
        self.losses: list[float] = []
        self.timer = metrics.PhaseTimer()
        self.done_at: list[float] = []  # per batch: seconds since start when its last backward ended here
        self.busy_at: list[float] = []  # per batch: forward+backward seconds spent by then
        self.dispatch = {
            Op.FORWARD: self.forward, Op.BACKWARD: self.backward,
            Op.RECV_ACT: self.recv_act, Op.SEND_ACT: self.send_act,
            Op.RECV_GRAD: self.recv_grad, Op.SEND_GRAD: self.send_grad,
            Op.REDUCE_GRADS: self.reduce_grads, Op.OPTIMIZER_STEP: self.optimizer_step,
        }

    # ------------------------------------------------------------------ the loop
    def run(self, program: list[Action], progress: StepProgress | None) -> dict:
        self.progress = progress
        dist.barrier()  # start the clock together
        metrics.synchronize(self.device)
        self.start = time.perf_counter()
        for action in program:
            self.dispatch[action.op](action)
        for work, _ in self.sends:
            work.wait(self.comms.timeout)
        metrics.synchronize(self.device)
        return self.report()

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
        self._recv(a, self.comms.prev, requires_grad=True)

    def recv_grad(self, a: Action) -> None:
        self._recv(a, self.comms.next, requires_grad=False)

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        tensor = tensor.contiguous()
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        self.sends.append((self.comms.send(tensor, to), tensor))

    def _recv(self, a: Action, source: int, requires_grad: bool) -> None:
        buffer = torch.empty(self.hidden_shape, dtype=torch.float32, device=self.device)
        with self.timer.phase("wait"):
            self.comms.recv(buffer, source)
        self.inbox[(a.op, a.microbatch)] = buffer.requires_grad_(requires_grad)

    # ------------------------------------------------------------------ updates
    def reduce_grads(self, a: Action) -> None:
        metrics.synchronize(self.device)
        self.done_at.append(time.perf_counter() - self.start)
        self.busy_at.append(self.timer.totals.get("forward", 0.0) + self.timer.totals.get("backward", 0.0))
        grads = self.versions.take_grads(weight_version(self.cfg.strategy.name, a.batch * self.m, self.m))
        loss = self.batch_loss.pop(a.batch) if self.last else None
        self.reductions[a.batch] = GradReduction(self.comms, grads, len(self.versions.buffers[0].tied_names), loss)

    def optimizer_step(self, a: Action) -> None:
        with self.timer.phase("wait"):
            loss, grads = self.reductions.pop(a.batch).finish()
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
    def report(self) -> dict:
        return {
            "rank": self.rank,
            "stage": self.stage,
            "replica": self.replica,
            "done_at": self.done_at,
            "busy_at": self.busy_at,
            "phases_s": dict(self.timer.totals),
            "losses": self.losses if self.last else None,
            "parameters": sum(p.numel() for p in self.versions.params[0]),
            "blocks": len(self.versions.buffers[0].model.blocks),
            "host_peak_rss_bytes": metrics.HostMemory().peak_bytes(),
            "device_memory": metrics.device_memory(self.device),
        }
