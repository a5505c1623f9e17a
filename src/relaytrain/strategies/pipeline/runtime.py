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

Each action type maps to one handler in a table (`handlers.py`; DeepSpeed's engine does the
same with its instructions), and what the handlers leave for later actions is one `InFlight`
(`inflight.py`), so the order of work lives in the schedule and the executor (`executor.py`:
the program's order, or message-driven within the schedule's rules) and this file keeps the
strategy's contract: steps, drains, evaluation, state. Where the weights live is `weights.py`
(on the device) or `offload.py` (masters and optimizer state in host memory).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from omegaconf import OmegaConf

from relaytrain.cost.formulas import ModelFacts, part_costs
from relaytrain.models.layered import MicroBatch, eval_mode
from relaytrain.objectives.base import Divisor
from relaytrain.placement.layout import Layout
from relaytrain.step.evaluation import EvalStats
from relaytrain.step.rounding import bf16_masters
from relaytrain.strategies.base import (
    Capabilities,
    StepResult,
    Strategy,
    minibatch_divisor,
    replica_rows,
    scalar,
)
from relaytrain.strategies.pipeline import report
from relaytrain.strategies.pipeline.comms import Comms, Mailbox, Outbox, Watcher
from relaytrain.strategies.pipeline.config import (
    Execution,
    Offload,
    PipelineConfig,
    check_layout,
    segment_batches,
)
from relaytrain.strategies.pipeline.cost import PipelineCost
from relaytrain.strategies.pipeline.executor import MessageDrivenExecutor, StaticExecutor
from relaytrain.strategies.pipeline.handlers import HANDLERS, apply_ready_updates
from relaytrain.strategies.pipeline.inflight import InFlight
from relaytrain.strategies.pipeline.jitter import ENV, StageJitter
from relaytrain.strategies.pipeline.offload import HostVersions
from relaytrain.strategies.pipeline.routing import Framing
from relaytrain.strategies.pipeline.schedule import Action, Op, Schedule, stop_points, virtual_stage
from relaytrain.strategies.pipeline.stage import StageModule, balanced_layout, partition
from relaytrain.strategies.pipeline.validate import StageInvariants, check_schedule
from relaytrain.strategies.pipeline.weights import VersionBuffers, WeightVersions
from relaytrain.utils.errors import ConfigError

_balanced_layouts: dict[tuple, list[int]] = {}  # the planner asks for the same layout many times


@dataclass
class Segment:
    """The program of batches [first, end) this stage is running, where each batch starts in it,
    and the invariants its work keeps so far (consulted by the message-driven executor)."""

    first: int
    end: int
    program: list[Action]
    starts: dict[int, int]  # batch -> index of the stage's first action of that batch
    invariants: StageInvariants

    def start(self, batch: int) -> int:
        return self.starts.get(batch, len(self.program))


class PipelineStrategy(Strategy):
    """One stage of one replica of a pipeline; subclasses name their schedule class, and what
    the strategy can honour follows from it."""

    Config = PipelineConfig
    cost_model = PipelineCost  # what the planner asks: pipeline/cost.py's closed forms, under this schedule
    capabilities = Capabilities(grad_clip=False, fp16=False, bf16_masters=True)  # bf16: with strategy.offload=host
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
    def rank_layout(cls, cfg) -> Layout:
        """`strategy.replicas` pipelines of `strategy.stages` stages each."""
        return Layout(replicate=cfg.strategy.replicas, stage=cfg.strategy.stages)

    @classmethod
    def reporter(cls, cfg) -> int:
        """The last stage of the first pipeline."""
        return cls.rank_layout(cfg).rank_of(stage=cfg.strategy.stages - 1)

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
        check_layout(s.layout, parts, m.num_layers, chunked=v > 1)
        cls.schedule.check_shape(s.stages, s.num_microbatches, cfg.train.steps, v)
        check_schedule(cls.schedule.build(s.stages, s.num_microbatches, min(cfg.train.steps, 3), chunks=v))
        if s.execution == Execution.message_driven and not cls.schedule.reorderable:
            raise ConfigError(f"strategy.execution=message_driven: strategy={s.name}'s order across its chunks is "
                              f"its schedule's; use strategy.execution=static")
        if bf16_masters(cfg.optim) and s.offload != Offload.host:
            raise ConfigError("optim.master_dtype=bf16 keeps a stage's masters on the host, in its eager param "
                              "server: add strategy.offload=host")
        jitter = StageJitter.from_environment()
        if jitter is not None and jitter.stage >= s.stages:
            raise ConfigError(f"{ENV} slows stage {jitter.stage}, but the pipeline has stages 0 to {s.stages - 1}")

    @classmethod
    def state_layout(cls, cfg) -> dict:
        """Blocks per model chunk (per stage, without interleaving) and the replicas."""
        return {"stages": [len(r) for r in cls.model_chunks(cfg)], "replicas": cfg.strategy.replicas}

    @classmethod
    def model_chunks(cls, cfg) -> list[range]:
        """The blocks of each of the model's d x v chunks, in model order: stage s holds chunks
        s, s + d, ... (one each without interleaving)."""
        s = cfg.strategy
        return partition(cfg.model.num_layers, s.stages * cls.chunks(cfg), cls.block_layout(cfg))

    @classmethod
    def block_layout(cls, cfg) -> list[int] | None:
        """Blocks per model chunk as `strategy.layout` asks (None: the even split). `balanced`
        (or no layout): cut by `formulas.part_costs`, the embeddings on the first chunk and the
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
    def dry_run_stand_in(cls, cfg, rank: int) -> int:
        """The same stage of replica 0: replicas run the same stage program on equal shares of
        every micro-batch, and in a dry run no gradient passes between them."""
        layout = cls.rank_layout(cfg)
        return layout.rank_of(stage=layout.coordinates(rank).stage)

    @classmethod
    def combine_reports(cls, cfg, reports: list[dict]) -> dict:
        """Per-stage figures, the bubble measured beside predicted (`report.combine_reports`)."""
        return report.combine_reports(cls, cfg, reports)

    # -- one stage -----------------------------------------------------------------------------
    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        s = cfg.strategy
        self.stage, self.replica = self.place.stage, self.place.replicate
        self.first, self.last = self.stage == 0, self.stage == s.stages - 1
        self.m, self.v = s.num_microbatches, self.chunks(cfg)
        self.steps = cfg.train.steps
        blocks = self.stage_blocks(cfg, self.stage)
        self.hidden_shape = (s.microbatch_size * model.objective.rows_per_item, cfg.data.seq_len, model.hf_config.hidden_size)
        self.framing = Framing.of(self.hidden_shape, model, blocks)  # a mixture's routing rides with the messages
        stage = StageModule(model, blocks, self.first, self.last, s.recompute)
        message_driven = s.execution == Execution.message_driven
        self.comms = Comms(self.layout, world.rank, bool(stage.tied_names), world.timeout_s, dry=world.simulated,
                           lanes=message_driven)
        self.versions = self._weights(stage)
        self.watcher = Watcher(self.comms.timeout, self.comms.poll)
        self.mailbox = Mailbox(self.comms, self.framing.buffer_shape, self.device, self.watcher, watch=message_driven)
        self.outbox = Outbox(self.comms, self.watcher)
        self.executor = MessageDrivenExecutor(self) if message_driven else StaticExecutor(self)
        jitter = None if world.simulated else StageJitter.from_environment()
        self.jitter = jitter if jitter is not None and jitter.stage == self.stage else None
        self.injected = jitter  # the run's setting, for every stage's report
        self.segment: Segment | None = None
        self.drain_s = 0.0  # time spent finishing batches in flight between steps (checkpoints, evaluations)
        self.batch = 0  # the next batch `step` runs
        self.inflight = InFlight()  # what the handlers leave for later actions

    def _weights(self, stage: StageModule) -> VersionBuffers:
        """The stage's weight versions: all on the device, or the masters and optimizer state on
        the host (`strategy.offload=host`; the stage stays where the model was built: the host)."""
        versions, optim = self.capabilities.weight_versions, self.cfg.optim
        if self.cfg.strategy.offload == Offload.host:
            return HostVersions(stage, versions, optim, self.device, self.cfg.train.seed)
        return WeightVersions(stage.to(self.device), versions, optim)

    def start(self, step: int) -> None:
        self.batch = step

    # -- steps ------------------------------------------------------------------------------
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        c = self.batch
        self.inflight.lrs[c] = lr
        replicas = self.layout.replicate
        divisor = minibatch_divisor(self.versions.buffers[0].model, minibatch, replicas) if self.last else Divisor(1)
        self.inflight.keep(c, replica_rows(minibatch, self.replica, replicas), divisor)
        if self.segment is None:
            self.segment = self._segment(c, min(self.steps, c + segment_batches()))
        seg = self.segment
        with self.timer.phase("step"):
            self.executor.run(seg.program, seg.start(c), seg.start(c + 1), seg.invariants)
            self.batch = c + 1
            if self.batch == seg.end:  # the program ran to its end
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
        return Segment(first, end, program, starts, StageInvariants(schedule, self.stage))

    def _end_segment(self) -> None:
        """Everything begun has finished: sends delivered, updates landed."""
        self.outbox.flush()
        self.versions.settle()
        self.segment = None

    def do(self, action: Action) -> None:
        """One action of the program (the executor decides which, and when)."""
        HANDLERS[action.op](self, action)
        apply_ready_updates(self)

    def _loss(self, batch: int) -> float | None:
        """Batch `batch`'s loss on the last stage (summed over replicas); None on other stages."""
        if not self.last:
            return None
        return scalar(self.sum_over_replicas(self.inflight.batch_loss.pop(batch)))

    def sum_over_replicas(self, values: torch.Tensor) -> torch.Tensor:
        """Over the last stages of every replica (gloo: CPU tensors), elsewhere as they are."""
        if self.comms.loss_group is not None:  # its own group: never queued behind a gradient sum
            self.comms.all_reduce(values, self.comms.loss_group)
        return values

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, batches: list[list[MicroBatch]]) -> EvalStats | None:
        """A forward-only schedule on the newest weights: each micro-batch flows through the
        stages (round them once per chunk); the last stages add up the evaluation sums, then
        over the replicas."""
        module = self.versions.latest()
        stats = EvalStats.zeros(module.model.num_labels) if self.last else None
        with eval_mode(module), torch.no_grad(), self.precision.autocast_context(self.device):
            for minibatch in batches:
                for mb in replica_rows(minibatch, self.replica, self.layout.replicate):
                    found = forward_only(module, mb.to(self.device), self.v, self.comms, self.framing)
                    stats = stats + found if found is not None else stats
        if self.last and self.comms.replica_group is not None:
            self.comms.all_reduce(stats.sums, self.comms.replica_group)
        return stats if self.world.rank == self.reporter(self.cfg) else None

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

    def loss_term_sums(self) -> dict[str, tuple[float, int]]:
        """The last stage's terms: its head runs on the model copies of the weight versions
        (2BW keeps two; host offload computes with a copy); other stages' counts are 0."""
        sums: dict[str, tuple[float, int]] = {}
        for module in self.versions.buffers:
            for name, (total, count) in module.model.loss_term_sums().items():
                before = sums.get(name, (0.0, 0))
                sums[name] = (before[0] + total, before[1] + count)
        return sums

    def memory_holders(self) -> dict[str, list]:
        params = self.versions.device_tensors()
        return {"weights": params, "gradients": [p.grad for p in params] + self.inflight.reduced(),
                "optimizer state": self.versions.device_optimizer_state(),
                "stash": self.inflight.stashed()}

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict:
        """This stage's measured figures, for `combine_reports`: throughput and bubble over its
        steps, waits, memory, the executor's own."""
        phases = dict(self.timer.totals)
        busy = phases.get("forward", 0.0) + phases.get("backward", 0.0)
        wall, steps = phases.get("step", 0.0), self.timer.counts.get("step", 0)
        s = self.cfg.strategy
        figures = {
            "rank": self.world.rank, "stage": self.stage, "replica": self.replica,
            "blocks": len(self.versions.buffers[0].model.blocks),
            "parameters": sum(p.numel() for p in self.versions.params[0]),
            "samples_per_s": s.microbatch_size * s.num_microbatches * steps / wall if wall > 0 else 0.0,
            "bubble_fraction": 1.0 - busy / wall if wall > 0 else 0.0,
            "phases_s": phases, "drain_s": self.drain_s, "steps": steps,
            "message_wait_s": phases.get("message_wait", 0.0),  # blocked on an activation or gradient
            "exposed_update_s": phases.get("optimizer", 0.0) + phases.get("update_wait", 0.0),
            "device_peak_bytes": report.device_peak(self.device),
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


def forward_only(module, mb: MicroBatch, chunks: int, comms, framing: Framing) -> EvalStats | None:
    """One micro-batch's evaluation through this stage's `chunks`: received from the stage before
    and sent on to the next, a mixture's routing sums riding along as in training; the evaluation
    sums on the stage whose chunk holds the head (None elsewhere)."""
    stats = None
    for chunk in range(chunks):
        hidden, upstream = None, None
        if not module.embeds(chunk):
            buffer = torch.empty(framing.buffer_shape(Op.RECV_ACT), dtype=torch.float32, device=mb.input_ids.device)
            hidden, upstream = framing.split(comms.recv(buffer, comms.prev))
        routing = framing.unit(chunk, upstream)
        out = module.trunk(mb, hidden, chunk, routing)
        if module.computes_loss(chunk):
            stats = module.model.eval_stats(out, mb)
        else:
            sums = routing.forward_message(out.device) if routing is not None else None
            comms.send(framing.join(out.float().contiguous(), sums), comms.next).wait(comms.timeout)
    return stats
