"""A pipeline stage as a strategy: each process runs one stage of one replica, one batch per step.

A stage's whole run is a *program* (`schedule.py`): the 1F1B (or GPipe) order of its forwards,
backwards, transfers, gradient reductions and optimizer steps. `step(c)` executes the slice of
the program that batch c adds: from the stage's first action of batch c to its first action
of batch c+1 (`schedule.stop_points`). Under 2BW those slices overlap batches, as the
pipeline does; the last stage's slice c holds all of batch c's forwards and backwards, so it
knows batch c's loss when its step returns.

`drain()` (before a checkpoint, an evaluation, or a stop) switches to the program of the
batches run so far and runs it to its end: the stage finishes exactly what it began, and all
stages stop at the same batch. The next `step` starts a new program from there (for 2BW on the
two weight versions the drained program left).

Each action type maps to one method (DeepSpeed's engine does the same with its instructions),
so the order of work lives entirely in the schedule; this file only knows how to do each kind
of work.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from relaytrain.checkpoint import load_optimizer_state, optimizer_state
from relaytrain.config import StrategyConfig, WorkersConfig
from relaytrain.errors import ConfigError
from relaytrain.evaluation import EvalStats
from relaytrain.models.layered import MicroBatch, eval_mode
from relaytrain.optim import build_optimizer, set_lr
from relaytrain.strategies.base import (
    FP32,
    Capabilities,
    StepResult,
    Strategy,
    cpu_activation_bytes,
    minibatch_items,
    optimizer_tensors,
    optimizer_words,
    replica_rows,
    scalar,
)
from relaytrain.strategies.baseline import Recompute
from relaytrain.strategies.pipeline.comms import Comms, GradReduction, TiedExchange, Topology
from relaytrain.strategies.pipeline.schedule import (
    Action,
    Op,
    build_schedule,
    check_shape,
    stop_points,
    weight_version,
)
from relaytrain.strategies.pipeline.stage import StageModule, partition
from relaytrain.strategies.pipeline.validate import bubble_formula, check_schedule, simulate

RECEIVE = (Op.RECV_ACT, Op.RECV_GRAD)
RECVS_AHEAD = 1  # receives posted ahead of their action, per direction (gloo; see Comms.async_p2p)
WORKER_OVERHEAD_BYTES = int(0.5 * 2**30)  # Python, torch and transformers in each worker


@dataclass
class PipelineConfig(WorkersConfig, StrategyConfig):
    stages: int = 2  # pipeline depth: worker processes per replica, each holding consecutive blocks
    layout: list[int] | None = None  # blocks per stage, overriding the even split
    recompute: Recompute = Recompute.none  # block: each block's input kept; stage: each stage's input (2BW paper)


class WeightVersions:
    """The stage's weights: one buffer (flush) or two (2BW), version v living in buffer v % 2.

    2BW's update W(b+1) = W(b) - lr * grad(W(b-1)) goes into the buffer that held W(b-1):
    batch b, its only user, is finished by then, while W(b) must stay untouched for the
    in-flight micro-batches of batch b+1. The optimizer follows the newest buffer, its state
    re-keyed to that buffer's parameters, so two versions plus one optimizer state is all a
    stage keeps.
    """

    def __init__(self, stage: StageModule, versions: int, optim_cfg):
        self.buffers = [stage] + [copy.deepcopy(stage) for _ in range(versions - 1)]
        # Tied weights last: GradReduction sums them over a different group.
        self.names = [n for n, _ in stage.named_parameters() if n not in stage.tied_names] + stage.tied_names
        self.params = [[dict(b.named_parameters())[n] for n in self.names] for b in self.buffers]
        self.hf_names = [stage.model.hf_name(p) for p in self.params[0]]
        self.optimizer = build_optimizer(zip(self.names, self.params[0], strict=True), optim_cfg)
        self.updates = 0

    def module(self, version: int) -> StageModule:
        return self.buffers[version % len(self.buffers)]

    def latest(self) -> StageModule:
        return self.module(self.updates)

    def take_grads(self, version: int) -> list[torch.Tensor | None]:
        """Gradients accumulated on `version`'s buffer (None where a parameter got none, which
        the optimizer then skips, as the baseline's does); the buffer's .grad is cleared."""
        grads = []
        for p in self.params[version % len(self.buffers)]:
            grads.append(p.grad)
            p.grad = None
        return grads

    def apply(self, grads: list[torch.Tensor | None], lr: float) -> None:
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

    def state(self) -> tuple[dict, dict, dict | None]:
        """Weights of the newest version and optimizer state by Hugging Face name, and (2BW) the
        previous version, which the next batch still computes with."""
        name = dict(zip(map(id, self.params[self.updates % len(self.buffers)]), self.hf_names, strict=True))
        newest = self._by_name(self.updates)
        optimizer = optimizer_state([self.optimizer], lambda p: name[id(p)])
        previous = self._by_name(self.updates - 1) if len(self.buffers) == 2 else None
        return newest, optimizer, previous

    def load_state(self, updates: int, weights: dict, optimizer: dict, previous: dict | None) -> None:
        """The inverse of `state` at `updates` optimizer steps; without `previous` (a checkpoint
        from another strategy) the previous version starts equal to the newest."""
        self.updates = updates
        self._load(updates, weights)
        if len(self.buffers) == 2:
            self._load(updates - 1, previous if previous else weights)
        newest = self.params[updates % len(self.buffers)]
        if newest is not self.params[0]:  # the optimizer follows the newest buffer
            self._rekey_optimizer(self.params[0], newest)
        name = dict(zip(map(id, newest), self.hf_names, strict=True))
        load_optimizer_state([self.optimizer], lambda p: name[id(p)], optimizer)

    def _by_name(self, version: int) -> dict[str, torch.Tensor]:
        params = self.params[version % len(self.buffers)]
        return {n: p.detach().cpu().clone() for n, p in zip(self.hf_names, params, strict=True)}

    def _load(self, version: int, weights: dict) -> None:
        with torch.no_grad():
            for n, p in zip(self.hf_names, self.params[version % len(self.buffers)], strict=True):
                p.copy_(weights[n])

    def _rekey_optimizer(self, source: list[torch.Tensor], target: list[torch.Tensor]) -> None:
        position = {id(p): i for i, p in enumerate(source)}
        for group in self.optimizer.param_groups:
            group["params"] = [target[position[id(p)]] for p in group["params"]]
        self.optimizer.state = defaultdict(
            dict, {target[position[id(p)]]: state for p, state in self.optimizer.state.items()}
        )


@dataclass
class Segment:
    """The program of batches [first, end) this stage is running, and where each batch starts in it."""

    first: int
    program: list[Action]
    starts: dict[int, int]  # batch -> index of the stage's first action of that batch

    def start(self, batch: int) -> int:
        return self.starts.get(batch, len(self.program))


class PipelineStrategy(Strategy):
    """One stage of one replica of a pipeline; subclasses name their schedule."""

    Config = PipelineConfig
    capabilities = Capabilities(grad_clip=False, fp16=False)
    schedule: ClassVar[str] = ""  # the kind `schedule.build_schedule` makes

    # -- what it needs -----------------------------------------------------------------------
    @classmethod
    def processes(cls, cfg) -> int:
        return cfg.strategy.stages * cfg.strategy.replicas

    @classmethod
    def replicas(cls, cfg) -> int:
        return cfg.strategy.replicas

    @classmethod
    def reporter(cls, cfg) -> int:
        return Topology(cfg.strategy.stages, cfg.strategy.replicas).rank(cfg.strategy.stages - 1, 0)

    @classmethod
    def check_config(cls, cfg) -> None:
        s, m = cfg.strategy, cfg.model
        if s.stages < 2:
            raise ConfigError(f"strategy.stages={s.stages}: one stage is not a pipeline; use strategy=baseline "
                              f"(or strategy.stages=2 or more)")
        if s.replicas < 1:
            raise ConfigError(f"strategy.replicas={s.replicas} must be at least 1")
        if s.stages > m.num_layers:
            raise ConfigError(f"strategy.stages={s.stages} exceeds model.num_layers={m.num_layers}; "
                              f"every stage needs a block")
        if s.layout is not None and (len(s.layout) != s.stages or sum(s.layout) != m.num_layers or min(s.layout) < 1):
            raise ConfigError(f"strategy.layout={list(s.layout)} must give {s.stages} positive block counts "
                              f"summing to model.num_layers={m.num_layers}")
        check_shape(cls.schedule, s.stages, s.num_microbatches, cfg.train.steps)
        check_schedule(build_schedule(cls.schedule, s.stages, s.num_microbatches, min(cfg.train.steps, 3)))

    @classmethod
    def estimate_host_bytes(cls, cfg, num_params: int, device_type: str) -> int:
        s = cfg.strategy
        versions = cls.capabilities.weight_versions
        in_flight = min(s.stages, s.num_microbatches) if cls.schedule != "gpipe" else s.num_microbatches
        per_replica = num_params * FP32 * (versions + 1 + optimizer_words(cfg))
        if s.recompute == Recompute.none:
            per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=cfg.model.num_layers * in_flight)
        else:
            per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=s.stages,
                                                stash_entries=cfg.model.num_layers * in_flight)
        # Each worker builds the whole model once before keeping its stage.
        workers = cls.processes(cfg) * (WORKER_OVERHEAD_BYTES + num_params * FP32)
        return int(workers + s.replicas * per_replica)

    @classmethod
    def layout(cls, cfg) -> dict:
        s = cfg.strategy
        return {"stages": [len(r) for r in partition(cfg.model.num_layers, s.stages, s.layout)],
                "replicas": s.replicas}

    @classmethod
    def describe_process(cls, cfg, rank: int) -> str:
        return Topology(cfg.strategy.stages, cfg.strategy.replicas).describe(rank)

    @classmethod
    def summarize(cls, cfg, reports: list[dict]) -> dict:
        """Per-stage figures and the bubble (idle share of step time, measured over the steps
        after warm-up), next to what the bubble formula and the schedule's dry run predict."""
        s = cfg.strategy
        stages = [r["stage_figures"] for r in reports]
        measured = sum(st["bubble_fraction"] for st in stages) / len(stages)
        formula = bubble_formula(s.stages, s.num_microbatches) if cls.schedule != "pipe_2bw" else 0.0
        simulated = simulate(build_schedule(cls.schedule, s.stages, s.num_microbatches, cfg.train.steps)).bubble_fraction()
        layout = cls.layout(cfg)["stages"]
        return {
            "stages": s.stages,
            "replicas": s.replicas,
            "layout": layout,
            "per_stage": stages,
            "bubble_fraction_measured": measured,
            "bubble_fraction_formula": formula,
            "bubble_fraction_schedule": simulated,
            "bubble_note": "formula: (d-1)/(m+d-1) per flush; pipe_2bw has no flush (0 in steady state). "
                           "schedule: dry run of the whole run with backward = 2 x forward",
            "summary": {
                "pipeline": f"{s.stages} stages x {s.replicas} replicas, blocks {layout}",
                "bubble measured / formula": f"{measured:.3f} / {formula:.3f}",
                "stage samples/s": ", ".join(f"{st['samples_per_s']:.1f}" for st in stages),
            },
        }

    # -- one stage -----------------------------------------------------------------------------
    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        s = cfg.strategy
        self.topology = Topology(s.stages, s.replicas)
        self.stage, self.replica = self.topology.position(world.rank)
        self.first, self.last = self.stage == 0, self.stage == s.stages - 1
        self.m = s.num_microbatches
        self.steps = cfg.train.steps
        blocks = partition(model.num_blocks, s.stages, s.layout)[self.stage]
        stage = StageModule(model, blocks, self.first, self.last, s.recompute).to(self.device)
        self.comms = Comms(self.topology, world.rank, bool(stage.tied_names), world.timeout_s, dry=world.simulated)
        self.versions = WeightVersions(stage, self.capabilities.weight_versions, cfg.optim)
        self.num_tied = len(stage.tied_names)
        self.hidden_shape = (s.microbatch_size, cfg.data.seq_len, stage.model.hf_config.hidden_size)
        self.segment: Segment | None = None
        self.drain_s = 0.0  # time spent finishing batches in flight between steps (checkpoints, evaluations)
        self.batch = 0  # the next batch `step` runs
        self.lrs: dict[int, float] = {}
        self.minibatches: dict[int, tuple[list[MicroBatch], int]] = {}
        self.stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # k -> (input, output)
        self.inbox: dict[tuple[Op, int], torch.Tensor] = {}
        self.posted: dict[tuple[Op, int], tuple[dist.Work, torch.Tensor]] = {}  # receives under way
        self.tied_recvs: dict[int, TiedExchange] = {}  # per batch: the partner's tied gradients, posted early
        self.grads_out: dict[int, torch.Tensor] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []  # kept alive until delivered
        self.batch_loss: dict[int, torch.Tensor] = {}
        self.reductions: dict[int, GradReduction] = {}  # reduced, not yet applied (in batch order)
        self.dispatch = {
            Op.FORWARD: self.forward, Op.BACKWARD: self.backward,
            Op.RECV_ACT: self.recv_act, Op.SEND_ACT: self.send_act,
            Op.RECV_GRAD: self.recv_grad, Op.SEND_GRAD: self.send_grad,
            Op.REDUCE_GRADS: self.reduce_grads, Op.OPTIMIZER_STEP: self.optimizer_step,
        }

    def start(self, step: int) -> None:
        self.batch = step

    # -- steps ------------------------------------------------------------------------------
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        c = self.batch
        self.lrs[c] = lr
        self._keep(c, minibatch)
        if self.segment is None:
            self.segment = self._segment(c, self.steps)
        with self.timer.phase("step"):
            self._run(self.segment.program, self.segment.start(c), self.segment.start(c + 1))
            self.batch = c + 1
            if self.batch == self.steps:  # the program ran to its end
                self._end_segment()
            loss = self._loss(c)
        return StepResult(loss=loss)

    def drain(self) -> None:
        if self.segment is None:
            return
        seg, c = self.segment, self.batch
        if c > seg.first:
            shorter = self._segment(seg.first, c).program  # equal to seg.program up to batch c's start
            start = time.perf_counter()
            with self.timer.paused():  # the phases cover the steps; a drain runs between them
                self._run(shorter, seg.start(c), len(shorter))
            self.drain_s += time.perf_counter() - start
        self._end_segment()

    def _segment(self, first: int, end: int) -> Segment:
        s = self.cfg.strategy
        program = build_schedule(self.schedule, s.stages, self.m, end, first).actions(self.stage)
        starts = {c: i for i, c in stop_points(program, self.m).items()}
        starts[first] = 0
        return Segment(first, program, starts)

    def _end_segment(self) -> None:
        for work, _ in self.sends:
            work.wait(self.comms.timeout)
        self.sends = []
        self.segment = None

    def _run(self, program: list[Action], start: int, end: int) -> None:
        ahead = start
        for i in range(start, end):
            if self.comms.async_p2p:
                ahead = self._post_receives(program, max(ahead, i), end)
            self.dispatch[program[i].op](program[i])
            self._apply_ready_updates()

    def _post_receives(self, program: list[Action], start: int, horizon: int) -> int:
        """Post the receives of program[start:horizon] in program order (each peer sends in that
        order), at most RECVS_AHEAD per direction outstanding, so the data arrives while this
        stage computes instead of after it asks. Returns the index up to which all are posted.

        Never past `horizon`, the end of this step's slice: the stages may drain there instead,
        and a receive posted for a transfer that never comes would be left behind.
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

    def _loss(self, batch: int) -> float | None:
        """Batch `batch`'s loss on the last stage (summed over replicas); None on other stages."""
        if not self.last:
            return None
        loss = self.batch_loss.pop(batch)
        if self.comms.loss_group is not None:  # its own group: never queued behind a gradient sum
            self.comms.all_reduce(loss, self.comms.loss_group)
        return scalar(loss)

    # -- compute ----------------------------------------------------------------------------
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
        if self.last:
            self.progress(f"micro-batch {a.microbatch % self.m + 1}/{self.m} through the pipeline")

    # -- transfers ----------------------------------------------------------------------------
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

    # -- updates ------------------------------------------------------------------------------
    def reduce_grads(self, a: Action) -> None:
        grads = self.versions.take_grads(weight_version(self.schedule, a.batch * self.m, self.m))
        reduction = GradReduction(self.comms, grads, self.num_tied, self.tied_recvs.pop(a.batch, None))
        self.reductions[a.batch] = reduction
        self.sends.extend(reduction.sends)

    def optimizer_step(self, a: Action) -> None:
        """The schedule's deadline for batch a.batch's update: apply it now unless it already was."""
        if a.batch in self.reductions:
            self._apply_update(a.batch)

    def _apply_ready_updates(self) -> None:
        """Apply each reduced update as soon as its sums have arrived (the paper's 2BW: the
        gradients of batch b are freed before batch b+1's accumulate), in batch order. The
        buffer an update writes held version b-1, which nothing needs once batch b's
        backwards are done here, so an early update never breaks the version rule."""
        while self.reductions:
            batch = min(self.reductions)
            if not self.reductions[batch].ready():
                return
            self._apply_update(batch)

    def _apply_update(self, batch: int) -> None:
        with self.timer.phase("wait"):
            grads = self.reductions.pop(batch).finish()
        with self.timer.phase("optimizer"):
            self.versions.apply(grads, self.lrs.pop(batch))

    # -- data ---------------------------------------------------------------------------------
    def _keep(self, batch: int, minibatch: list[MicroBatch]) -> None:
        """This replica's rows of the global minibatch, and its loss items (2BW overlaps two batches)."""
        self.minibatches.pop(batch - 2, None)
        items = minibatch_items(self.versions.buffers[0].model, minibatch) if self.last else 1
        self.minibatches[batch] = (replica_rows(minibatch, self.replica, self.topology.replicas), items)

    def _microbatch(self, k: int) -> tuple[MicroBatch, int]:
        rows, items = self.minibatches[k // self.m]
        return rows[k % self.m].to(self.device, non_blocking=True), items

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, batches: list[list[MicroBatch]]) -> EvalStats | None:
        """A forward-only schedule on the newest weights: each micro-batch flows through the
        stages; the last stages add up the evaluation sums, then over the replicas."""
        module = self.versions.latest()
        model = module.model
        stats = EvalStats.zeros(model.num_labels) if self.last else None
        with eval_mode(module), torch.no_grad(), self.precision.autocast_context(self.device):
            for minibatch in batches:
                for mb in replica_rows(minibatch, self.replica, self.topology.replicas):
                    mb = mb.to(self.device)
                    hidden = None if self.first else self.comms.recv(self._buffer(), self.comms.prev)
                    out = module.trunk(mb, hidden)
                    if self.last:
                        stats += model.eval_stats(out, mb.labels)
                    else:
                        self.comms.send(out.float().contiguous(), self.comms.next).wait(self.comms.timeout)
        if self.last and self.comms.replica_group is not None:
            self.comms.all_reduce(stats.sums, self.comms.replica_group)
        return stats if self.world.rank == self.reporter(self.cfg) else None

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.hidden_shape, dtype=torch.float32, device=self.device)

    # -- state ----------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return list(self.versions.hf_names)

    def weights(self) -> dict[str, torch.Tensor] | None:
        return self.versions.state()[0] if self.replica == 0 else None

    def state_dict(self) -> dict | None:
        if self.replica != 0:  # replicas hold bit-identical weights and optimizer state
            return None
        weights, optimizer, previous = self.versions.state()
        return {"weights": weights, "optimizer": optimizer, "scaler": None,
                "extra": {"previous_weights": previous} if previous is not None else None}

    def load_state_dict(self, state: dict) -> None:
        previous = (state["extra"] or {}).get("previous_weights")
        self.versions.load_state(self.batch, state["weights"], state["optimizer"], previous)

    def memory_holders(self) -> dict[str, list]:
        params = [p for version in self.versions.params for p in version]
        reduced = [g for r in self.reductions.values() for g in r.tensors()]
        return {"weights": params, "gradients": [p.grad for p in params] + reduced,
                "optimizer state": optimizer_tensors([self.versions.optimizer]),
                "stash": [t for pair in self.stash.values() for t in pair]}

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict:
        phases = dict(self.timer.totals)
        busy = phases.get("forward", 0.0) + phases.get("backward", 0.0)
        wall = phases.get("step", 0.0)
        steps = self.timer.counts.get("step", 0)
        s = self.cfg.strategy
        samples = s.microbatch_size * s.num_microbatches
        return {
            "stage_figures": {
                "rank": self.world.rank,
                "stage": self.stage,
                "replica": self.replica,
                "blocks": len(self.versions.buffers[0].model.blocks),
                "parameters": sum(p.numel() for p in self.versions.params[0]),
                "samples_per_s": samples * steps / wall if wall > 0 else 0.0,
                "bubble_fraction": 1.0 - busy / wall if wall > 0 else 0.0,
                "phases_s": phases,
                "drain_s": self.drain_s,
            }
        }
