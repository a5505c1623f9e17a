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
so the order of work lives in the schedule and the executor (`executor.py`: the program's
order, or message-driven within the schedule's rules); this file only knows how to do each
kind of work. Where the weights live is `weights.py` (on the device) or `offload.py`
(masters and optimizer state in host memory).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
from omegaconf import OmegaConf

from relaytrain import memory
from relaytrain.config import Recompute
from relaytrain.costmodel import (
    FP32,
    ModelFacts,
    Shape,
    StepCost,
    allreduce_s,
    both,
    optimizer_s,
    p2p_s,
    part_costs,
    powers_of_two_dividing,
    stage_bytes,
)
from relaytrain.errors import ConfigError
from relaytrain.evaluation import EvalStats
from relaytrain.models.layered import MicroBatch, eval_mode
from relaytrain.optim import state_words
from relaytrain.profile import Profile, Timings
from relaytrain.strategies.base import (
    Capabilities,
    StepResult,
    Strategy,
    cpu_activation_bytes,
    minibatch_items,
    replica_rows,
    scalar,
)
from relaytrain.strategies.pipeline.comms import (
    TIED_TAG,
    Comms,
    GradReduction,
    Mailbox,
    Outbox,
    TiedExchange,
    Topology,
    Watcher,
)
from relaytrain.strategies.pipeline.config import Execution, Offload, PipelineConfig
from relaytrain.strategies.pipeline.executor import MessageDrivenExecutor, StaticExecutor
from relaytrain.strategies.pipeline.jitter import ENV, StageJitter
from relaytrain.strategies.pipeline.offload import HostVersions
from relaytrain.strategies.pipeline.schedule import Action, Op, Schedule, stop_points, virtual_stage
from relaytrain.strategies.pipeline.stage import StageModule, balanced_layout, partition
from relaytrain.strategies.pipeline.validate import StageInvariants, check_schedule, simulate
from relaytrain.strategies.pipeline.weights import VersionBuffers, WeightVersions
from relaytrain.units import gib

WORKER_OVERHEAD_BYTES = int(0.5 * 2**30)  # Python, torch and transformers in each worker
LAYOUTS = ("balanced", "even")  # strategy.layout's words; otherwise a list of blocks per model chunk
_balanced_layouts: dict[tuple, list[int]] = {}  # the planner asks for the same layout many times


@dataclass
class Segment:
    """The program of batches [first, end) this stage is running, where each batch starts in it,
    and the invariants its work keeps so far (consulted by the message-driven executor)."""

    first: int
    program: list[Action]
    starts: dict[int, int]  # batch -> index of the stage's first action of that batch
    invariants: StageInvariants

    def start(self, batch: int) -> int:
        return self.starts.get(batch, len(self.program))


class PipelineStrategy(Strategy):
    """One stage of one replica of a pipeline; subclasses name their schedule class, and what
    the strategy can honour follows from it."""

    Config = PipelineConfig
    capabilities = Capabilities(grad_clip=False, fp16=False)
    schedule: ClassVar[type[Schedule]]  # the program each stage runs, and its rules

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "schedule" in cls.__dict__:  # one owner for each rule: the schedule says, the strategy follows
            cls.stop_lag = cls.schedule.stop_lag
            cls.capabilities = dataclasses.replace(cls.capabilities, weight_versions=cls.schedule.weight_versions)

    # -- what it needs -----------------------------------------------------------------------
    @classmethod
    def chunks(cls, cfg) -> int:
        """Model chunks per stage: one, or several under an interleaved schedule."""
        return 1

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
        parts, v = s.stages * cls.chunks(cfg), cls.chunks(cfg)
        what = f"strategy.stages={s.stages}" + (f" x strategy.chunks={v}" if v > 1 else "")
        if parts > m.num_layers:
            raise ConfigError(f"{what} exceeds model.num_layers={m.num_layers}; every "
                              f"{'chunk' if v > 1 else 'stage'} needs a block")
        if not (s.layout is None or (isinstance(s.layout, str) and s.layout in LAYOUTS)):
            given = list(s.layout) if OmegaConf.is_list(s.layout) or isinstance(s.layout, list) else None
            if given is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in given) \
                    or len(given) != parts or sum(given) != m.num_layers or min(given) < 1:
                raise ConfigError(f"strategy.layout={given if given is not None else s.layout} must be balanced, "
                                  f"even or {parts} positive block counts (one per "
                                  f"{'model chunk' if v > 1 else 'stage'}) summing to model.num_layers={m.num_layers}")
        cls.schedule.check_shape(s.stages, s.num_microbatches, cfg.train.steps, v)
        check_schedule(cls.schedule.build(s.stages, s.num_microbatches, min(cfg.train.steps, 3), chunks=v))
        if s.execution == Execution.message_driven and not cls.schedule.reorderable:
            raise ConfigError(f"strategy.execution=message_driven: strategy={s.name}'s order across its chunks is "
                              f"its schedule's; use strategy.execution=static")
        jitter = StageJitter.from_environment()
        if jitter is not None and jitter.stage >= s.stages:
            raise ConfigError(f"{ENV} slows stage {jitter.stage}, but the pipeline has stages 0 to {s.stages - 1}")

    @classmethod
    def estimate_host_bytes(cls, cfg, num_params: int, device_type: str) -> int:
        s = cfg.strategy
        versions, v = cls.schedule.weight_versions, cls.chunks(cfg)
        # The first stage holds the most; a unit in flight holds a chunk's blocks.
        in_flight = -(-cls.schedule.in_flight(s.stages, s.num_microbatches, 0, v) // v)
        masters = 1 if s.offload == Offload.host else 0  # host copies of the weights, apart from the working ones
        per_replica = num_params * FP32 * (versions + 1 + state_words(cfg.optim) + masters)
        if s.recompute == Recompute.none:
            per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=cfg.model.num_layers * in_flight)
        else:
            per_replica += cpu_activation_bytes(cfg, device_type, live_blocks=s.stages,
                                                stash_entries=cfg.model.num_layers * in_flight)
        # Each worker builds the whole model once before keeping its stage.
        workers = cls.processes(cfg) * (WORKER_OVERHEAD_BYTES + num_params * FP32)
        return int(workers + s.replicas * per_replica)

    @classmethod
    def state_layout(cls, cfg) -> dict:
        """Blocks per model chunk (per stage, without interleaving) and the replicas."""
        return {"stages": [len(r) for r in cls.model_chunks(cfg)], "replicas": cfg.strategy.replicas}

    @classmethod
    def model_chunks(cls, cfg) -> list[range]:
        """The blocks of each of the model's d x v chunks, in model order: stage s holds chunks
        s, s + d, ... (one each without interleaving)."""
        s = cfg.strategy
        return partition(cfg.model.num_layers, s.stages * cls.chunks(cfg), cls.layout(cfg))

    @classmethod
    def layout(cls, cfg) -> list[int] | None:
        """Blocks per model chunk as `strategy.layout` asks (None: the even split). `balanced`
        (or no layout): cut by `costmodel.part_costs`, the embeddings on the first chunk and the
        head on the last, so that the costliest stage is as cheap as it can be (per chunk under
        interleaving). The costs come from the model's shapes, not from timings: every process,
        and a resumed run, computes the same split."""
        s = cfg.strategy
        if s.layout == "even":
            return None
        if s.layout is not None and s.layout != "balanced":
            return [int(n) for n in s.layout]
        parts, b, recompute = s.stages * cls.chunks(cfg), s.microbatch_size, str(s.recompute)
        key = (OmegaConf.to_yaml(cfg.model), cfg.data.seq_len, b, recompute, parts)
        if key not in _balanced_layouts:
            costs = part_costs(ModelFacts.of(cfg), b, recompute)
            _balanced_layouts[key] = balanced_layout([costs.block] * cfg.model.num_layers, parts, costs.embed, costs.head)
        return list(_balanced_layouts[key])

    @classmethod
    def stage_blocks(cls, cfg, stage: int) -> list[range]:
        """The blocks `stage` holds, one range per chunk."""
        chunks, stages = cls.model_chunks(cfg), cfg.strategy.stages
        return [chunks[virtual_stage(stage, c, stages)] for c in range(cls.chunks(cfg))]

    @classmethod
    def describe_process(cls, cfg, rank: int) -> str:
        return Topology(cfg.strategy.stages, cfg.strategy.replicas).describe(rank)

    @classmethod
    def dry_run_stand_in(cls, cfg, rank: int) -> int:
        """The same stage of replica 0: replicas run the same stage program on equal shares of
        every micro-batch, and in a dry run no gradient passes between them."""
        topology = Topology(cfg.strategy.stages, cfg.strategy.replicas)
        return topology.rank(topology.position(rank)[0], 0)

    @classmethod
    def combine_reports(cls, cfg, reports: list[dict]) -> dict:
        """Per-stage figures and the bubble (idle share of step time, measured over the steps
        after warm-up), next to what the bubble formula and the schedule's dry run predict."""
        s = cfg.strategy
        stages = [r["stage_figures"] for r in reports]
        measured = sum(st["bubble_fraction"] for st in stages) / len(stages)
        v = cls.chunks(cfg)
        formula = cls.schedule.bubble(s.stages, s.num_microbatches, v)
        simulated = simulate(cls.schedule.build(s.stages, s.num_microbatches, cfg.train.steps, chunks=v)).bubble_fraction()
        layout = cls.state_layout(cfg)["stages"]
        return {
            "stages": s.stages,
            "replicas": s.replicas,
            "layout": layout,
            "execution": str(s.execution),
            "offload": str(s.offload),
            "per_stage": stages,
            "bubble_fraction_measured": measured,
            "bubble_fraction_formula": formula,
            "bubble_fraction_schedule": simulated,
            "bubble_note": f"formula: {cls.schedule.bubble_words(s.stages, s.num_microbatches, v)}; "
                           "schedule: dry run of the whole run with backward = 2 x forward",
            "summary": {
                "pipeline": (f"{s.stages} stages x {s.replicas} replicas" + (f", {v} chunks each" if v > 1 else "")
                             + f", blocks {layout}"),
                "execution, offload": f"{s.execution}, {s.offload}",
                "bubble measured / formula": f"{measured:.3f} / {formula:.3f}",
                "stage samples/s": ", ".join(f"{st['samples_per_s']:.1f}" for st in stages),
                **_stage_rows(stages),
            },
        }

    # -- what the planner asks --------------------------------------------------------------------
    @classmethod
    def shapes(cls, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """Every worker in the pipeline: w x d = workers with 2 <= d <= the model's blocks and w
        dividing the batch; each micro-batch size b of a replica's share with m = batch / (w b) as
        the schedule allows; no recompute, block or stage recompute."""
        return [Shape(cls.name, b, batch // (workers // d * b), workers // d, d, str(recompute),
                      cls.shape_options(chunks=v) if v > 1 else ())
                for d in range(2, min(workers, num_layers) + 1) if workers % d == 0 and batch % (workers // d) == 0
                for b in powers_of_two_dividing(batch // (workers // d))
                for v in cls.chunk_choices(d, num_layers)
                if cls.schedule.refusal(d, batch // (workers // d * b), v) is None
                for recompute in Recompute]

    @classmethod
    def chunk_choices(cls, stages: int, num_layers: int) -> list[int]:
        """The model chunks per stage the planner tries on `stages` stages (one: no interleaving)."""
        return [1]

    @classmethod
    def recomputes(cls, cfg) -> bool:
        return cfg.strategy.recompute != Recompute.none

    @classmethod
    def step_cost(cls, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """PipeDream-2BW's THROUGHPUT(.) (§4.2.1) for one minibatch of m micro-batches on d stages
        x w replicas: stage i costs t_i = max(T_i^comp, T_i^comm) per micro-batch, compute (with
        recompute) and the activations and gradients exchanged with its neighbours overlapping;
        the schedule composes the minibatch from the t_i (filled and drained once, or kept full).
        Then the all-reduce of each stage's gradients across the replicas (hidden under the next
        minibatch where the schedule lets it) and the stage's optimizer step."""
        s, v = cfg.strategy, cls.chunks(cfg)
        m, d, b = s.num_microbatches, s.stages, s.microbatch_size
        t = profile.for_workers(cls.processes(cfg), cfg.train.threads)
        compute = cls._stage_times(cfg, t)
        exchange = v * p2p_s(facts.boundary_bytes(b), cls.processes(cfg), profile)  # one message per chunk
        slots = [max(work, exchange) for work in compute]
        pipeline = cls.schedule.minibatch_time(slots, m, v)
        stages = cls._stages(cfg)
        sums = max(allreduce_s(facts.stage_params(*stage) * FP32, s.replicas, profile) for stage in stages)
        hidden = cls.schedule.hides_gradient_sums and profile.device_type != "cpu"  # a CPU sums on the cores that compute
        exposed_sums = max(0.0, sums - pipeline) if hidden else sums
        optimizer = max(optimizer_s(t, facts, *stage) for stage in stages)
        parts = {"compute": m * max(compute), "bubble": pipeline - m * max(slots),
                 "activations exchange": 2 * m * exchange, "gradient sums (exposed)": exposed_sums,
                 "optimizer": optimizer}
        return StepCost(pipeline + exposed_sums + optimizer, parts,
                        [f"bubble {cls.schedule.bubble_words(d, m, v)}"])

    @classmethod
    def device_bytes(cls, cfg, facts: ModelFacts) -> int:
        """The fullest stage's MEMORY(.): its weight versions, gradients and optimizer state, and
        the activations of the micro-batches its schedule keeps in flight there."""
        s, v = cfg.strategy, cls.chunks(cfg)
        # A unit in flight holds one chunk's activations: 1/v of the stage's blocks.
        return max(stage_bytes(facts, s.microbatch_size, blocks, facts.stage_params(blocks, first, last), last,
                               cls.schedule.in_flight(s.stages, s.num_microbatches, i, v) / v,
                               cls.schedule.weight_versions, str(s.recompute))
                   for i, (blocks, first, last) in enumerate(cls._stages(cfg)))

    @classmethod
    def host_state_bytes(cls, cfg, facts: ModelFacts) -> int:
        """With `strategy.offload=host`, the fullest stage's fp32 masters, optimizer state and the
        gradients downloaded for the eager param server (AxoNN); otherwise none: every weight,
        gradient and optimizer state lives where the stage computes."""
        if cfg.strategy.offload != Offload.host:
            return 0
        largest = max(facts.stage_params(*stage) for stage in cls._stages(cfg))
        return int(largest * FP32 * (2 + facts.state_words))

    @classmethod
    def _stages(cls, cfg) -> list[tuple[int, bool, bool]]:
        """(blocks, holds the embeddings, holds the head) of each stage."""
        d = cfg.strategy.stages
        return [(sum(len(r) for r in cls.stage_blocks(cfg, i)), i == 0, i == d - 1) for i in range(d)]

    @classmethod
    def _stage_times(cls, cfg, t: Timings) -> list[float]:
        """T_i^comp: each stage's forward + backward (+ recompute) seconds for one micro-batch."""
        b, recompute = cfg.strategy.microbatch_size, cfg.strategy.recompute
        block, embed, head = (t.part(part, b) for part in ("block", "embed", "head"))
        times = []
        for blocks, first, last in cls._stages(cfg):
            work = blocks * both(block) + (both(embed) if first else 0.0) + (both(head) if last else 0.0)
            if recompute == Recompute.block:
                work += blocks * block.forward_s
            elif recompute == Recompute.stage:
                work += blocks * block.forward_s + (embed.forward_s if first else 0.0) + (head.forward_s if last else 0.0)
            times.append(work)
        return times

    # -- one stage -----------------------------------------------------------------------------
    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        s = cfg.strategy
        self.topology = Topology(s.stages, s.replicas)
        self.stage, self.replica = self.topology.position(world.rank)
        self.first, self.last = self.stage == 0, self.stage == s.stages - 1
        self.m, self.v = s.num_microbatches, self.chunks(cfg)
        self.steps = cfg.train.steps
        stage = StageModule(model, self.stage_blocks(cfg, self.stage), self.first, self.last, s.recompute)
        message_driven = s.execution == Execution.message_driven
        self.comms = Comms(self.topology, world.rank, bool(stage.tied_names), world.timeout_s, dry=world.simulated,
                           lanes=message_driven)
        self.versions = self._weights(stage)
        self.num_tied = len(stage.tied_names)
        self.hidden_shape = (s.microbatch_size, cfg.data.seq_len, stage.model.hf_config.hidden_size)
        self.watcher = Watcher(self.comms.timeout, self.comms.poll)
        self.mailbox = Mailbox(self.comms, self.hidden_shape, self.device, self.watcher, watch=message_driven)
        self.outbox = Outbox(self.comms, self.watcher)
        self.executor = MessageDrivenExecutor(self) if message_driven else StaticExecutor(self)
        jitter = None if world.simulated else StageJitter.from_environment()
        self.jitter = jitter if jitter is not None and jitter.stage == self.stage else None
        self.injected = jitter  # the run's setting, for every stage's report
        self.segment: Segment | None = None
        self.drain_s = 0.0  # time spent finishing batches in flight between steps (checkpoints, evaluations)
        self.batch = 0  # the next batch `step` runs
        self.lrs: dict[int, float] = {}
        self.minibatches: dict[int, tuple[list[MicroBatch], int]] = {}
        self.stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # unit -> (input, output)
        self.inbox: dict[tuple[Op, tuple[int, int]], torch.Tensor] = {}  # received, not yet computed with
        self.tied_recvs: dict[int, TiedExchange] = {}  # per batch: the partner's tied gradients, posted early
        self.grads_out: dict[tuple[int, int], torch.Tensor] = {}
        self.batch_loss: dict[int, torch.Tensor] = {}
        self.reductions: dict[int, GradReduction] = {}  # reduced, not yet applied (in batch order)
        self.dispatch = {
            Op.FORWARD: self.forward, Op.BACKWARD: self.backward,
            Op.RECV_ACT: self.recv_act, Op.SEND_ACT: self.send_act,
            Op.RECV_GRAD: self.recv_grad, Op.SEND_GRAD: self.send_grad,
            Op.REDUCE_GRADS: self.reduce_grads, Op.OPTIMIZER_STEP: self.optimizer_step,
        }

    def _weights(self, stage: StageModule) -> VersionBuffers:
        """The stage's weight versions: all on the device, or the masters and optimizer state on
        the host (`strategy.offload=host`; the stage stays where the model was built: the host)."""
        versions, optim = self.capabilities.weight_versions, self.cfg.optim
        if self.cfg.strategy.offload == Offload.host:
            return HostVersions(stage, versions, optim, self.device)
        return WeightVersions(stage.to(self.device), versions, optim)

    def start(self, step: int) -> None:
        self.batch = step

    # -- steps ------------------------------------------------------------------------------
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        c = self.batch
        self.lrs[c] = lr
        self._keep(c, minibatch)
        if self.segment is None:
            self.segment = self._segment(c, self.steps)
        seg = self.segment
        with self.timer.phase("step"):
            self.executor.run(seg.program, seg.start(c), seg.start(c + 1), seg.invariants)
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
                self.executor.run(shorter, seg.start(c), len(shorter), seg.invariants)
            self.drain_s += time.perf_counter() - start
        self._end_segment()

    def _segment(self, first: int, end: int) -> Segment:
        s = self.cfg.strategy
        schedule = self.schedule.build(s.stages, self.m, end, first, self.v)
        program = schedule.actions(self.stage)
        starts = {c: i for i, c in stop_points(program, self.m).items()}
        starts[first] = 0
        return Segment(first, program, starts, StageInvariants(schedule, self.stage))

    def _end_segment(self) -> None:
        """Everything begun has finished: sends delivered, updates landed."""
        self.outbox.flush()
        self.versions.settle()
        self.segment = None

    def do(self, action: Action) -> None:
        """One action of the program (the executor decides which, and when)."""
        self.dispatch[action.op](action)
        self._apply_ready_updates()

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
        module = self.versions.module(a.version)
        hidden = None if module.embeds(a.chunk) else self.inbox.pop((Op.RECV_ACT, a.unit))
        with self.timer.phase("update_wait"):  # offload: the update that made this version must have landed
            self.versions.await_version(a.version)
        with self.timer.phase("forward"), self._jittered("forward", a), self.precision.autocast_context(self.device):
            out = module(mb, hidden, items, a.chunk)
        self.stash[a.unit] = (hidden, out)
        if module.computes_loss(a.chunk):
            self.batch_loss[a.batch] = self.batch_loss.get(a.batch, 0.0) + out.detach()

    def backward(self, a: Action) -> None:
        hidden, out = self.stash.pop(a.unit)
        module = self.versions.module(a.version)
        if self.comms.tied_peer is not None and a.unit == (0, (a.batch + 1) * self.m - 1):
            # This stage's last backward of the batch: the partner's tied gradients may come during it.
            tied = self.versions.params[a.version % len(self.versions.buffers)][len(self.versions.names) - self.num_tied:]
            self.tied_recvs[a.batch] = TiedExchange(self.comms, tied)
        with self.timer.phase("backward"), self._jittered("backward", a):
            grad = None if module.computes_loss(a.chunk) else self.inbox.pop((Op.RECV_GRAD, a.unit))
            out.backward(grad)
        if not module.embeds(a.chunk):
            self.grads_out[a.unit] = hidden.grad
        if module.computes_loss(a.chunk):
            self.progress(f"micro-batch {a.microbatch % self.m + 1}/{self.m} through the pipeline")

    def _jittered(self, op: str, a: Action):
        """The injected delay of this stage, if RELAYTRAIN_STAGE_JITTER names it (a benchmarking aid)."""
        return self.jitter.around(op, a.microbatch, self.device) if self.jitter is not None else nullcontext()

    # -- transfers ----------------------------------------------------------------------------
    def send_act(self, a: Action) -> None:
        self._send(self.stash[a.unit][1].detach().float(), a)

    def send_grad(self, a: Action) -> None:
        self._send(self.grads_out.pop(a.unit), a)

    def recv_act(self, a: Action) -> None:
        self._recv(a, requires_grad=True)

    def recv_grad(self, a: Action) -> None:
        self._recv(a, requires_grad=False)

    def _send(self, tensor: torch.Tensor, a: Action) -> None:
        to, group, tag = self.comms.route(a)
        self.outbox.send(tensor, to, tag=tag, group=group)

    def _recv(self, a: Action, requires_grad: bool) -> None:
        with self.timer.phase("message_wait"):
            buffer = self.mailbox.take(a)
        self.inbox[(a.op, a.unit)] = buffer.requires_grad_(requires_grad)

    # -- updates ------------------------------------------------------------------------------
    def reduce_grads(self, a: Action) -> None:
        grads = self.versions.take_grads(self.schedule.weight_version(a.batch * self.m, self.m))
        reduction = GradReduction(self.comms, grads, self.num_tied, self.tied_recvs.pop(a.batch, None))
        self.reductions[a.batch] = reduction
        for work, tensor in reduction.sends:
            self.outbox.keep(work, tensor, self.comms.tied_peer, TIED_TAG)

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
        with self.timer.phase("reduction_wait"):
            grads = self.reductions.pop(batch).finish()
        with self.timer.phase("optimizer"):  # offload: only starting the update; it lands in the background
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
        stages (round them once per chunk); the last stages add up the evaluation sums, then
        over the replicas."""
        module = self.versions.latest()
        model = module.model
        stats = EvalStats.zeros(model.num_labels) if self.last else None
        with eval_mode(module), torch.no_grad(), self.precision.autocast_context(self.device):
            for minibatch in batches:
                for mb in replica_rows(minibatch, self.replica, self.topology.replicas):
                    mb = mb.to(self.device)
                    for chunk in range(self.v):
                        hidden = None if module.embeds(chunk) else self.comms.recv(self._buffer(), self.comms.prev)
                        out = module.trunk(mb, hidden, chunk)
                        if module.computes_loss(chunk):
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
        params = self.versions.device_tensors()
        reduced = [g for r in self.reductions.values() for g in r.tensors()]
        return {"weights": params, "gradients": [p.grad for p in params] + reduced,
                "optimizer state": self.versions.device_optimizer_state(),
                "stash": [t for pair in self.stash.values() for t in pair]}

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict:
        phases = dict(self.timer.totals)
        busy = phases.get("forward", 0.0) + phases.get("backward", 0.0)
        wall = phases.get("step", 0.0)
        steps = self.timer.counts.get("step", 0)
        s = self.cfg.strategy
        samples = s.microbatch_size * s.num_microbatches
        figures = {
            "rank": self.world.rank,
            "stage": self.stage,
            "replica": self.replica,
            "blocks": len(self.versions.buffers[0].model.blocks),
            "parameters": sum(p.numel() for p in self.versions.params[0]),
            "samples_per_s": samples * steps / wall if wall > 0 else 0.0,
            "bubble_fraction": 1.0 - busy / wall if wall > 0 else 0.0,
            "phases_s": phases,
            "drain_s": self.drain_s,
            "steps": steps,
            "message_wait_s": phases.get("message_wait", 0.0),  # blocked on an activation or gradient
            "exposed_update_s": phases.get("optimizer", 0.0) + phases.get("update_wait", 0.0),
            "device_peak_bytes": _device_peak(self.device),
            "host_offload_bytes": self.versions.host_bytes(),
            **self.executor.report(),  # message-driven: units run, and how many out of the static order
        }
        if s.offload == Offload.host:
            figures["eps"] = self.versions.report()
        if self.jitter is not None:
            figures["injected_delay"] = self.jitter.report()
        return {"stage_figures": figures}

    def close(self) -> None:
        self.watcher.close()
        self.versions.close()


def _device_peak(device: torch.device) -> int | None:
    """This stage's peak device memory: a dry run's simulated one, the CUDA allocator's, or None
    on the CPU (there the stage's memory is its process's host RSS, in memory.per_process)."""
    tracker = memory.active()
    if tracker is not None:
        return tracker.peak
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _stage_rows(stages: list[dict]) -> dict[str, str]:
    """Summary rows with one figure per stage: waiting, updates, memory, the executor's own."""
    def each(figure) -> str:
        return ", ".join(figure(st) for st in stages)

    def per_step(key: str):
        return lambda st: f"{st[key] / st['steps']:.3f}" if st["steps"] else "n/a"

    rows = {"stage message wait (s/step)": each(per_step("message_wait_s")),
            "stage exposed update (s/step)": each(per_step("exposed_update_s"))}
    if all(st["device_peak_bytes"] is not None for st in stages):
        rows["stage device peak"] = each(lambda st: gib(st["device_peak_bytes"]))
    if any(st["host_offload_bytes"] for st in stages):
        rows["stage host offload: masters + optimizer"] = each(lambda st: gib(sum(st["host_offload_bytes"].values())))
    if "units" in stages[0]:
        rows["stage units run out of static order"] = each(lambda st: f"{st['out_of_order']}/{st['units']}")
    for st in stages:
        if "injected_delay" in st:
            delay = st["injected_delay"]
            rows["injected delay (benchmarking aid)"] = (
                f"stage {delay['stage']}: U[0, {delay['max_fraction']:.0%}) of each compute, seed {delay['seed']}, "
                f"{delay['added_s']:.2f} s added")
    return rows
