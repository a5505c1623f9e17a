"""The strategy contract: everything the trainer, the launcher, the checkpoints, the report and
the planner need to know about a way of training, in one class per strategy.

A strategy owns *where the weights live* and *in what order work runs*. The class answers,
before any process starts, what a run needs (`rank_layout`: where each of its processes sits,
hence `processes` and `replicas`; `check_config`,
`state_layout`, `capabilities`) and, through the cost model it names (`cost_model`, a
`cost.model.CostModel`), what the planner and the host-memory check ask (`shapes`, `step_cost`,
`device_bytes`, `host_state_bytes`, `estimate_host_bytes`, `recomputes`); an instance, one per process,
does the work (`step`, `evaluate`, `drain`) and hands over its state (`state_dict`,
`load_state_dict`, `weights`) and figures (`report`, then the class's `combine_reports` over
every process's report).

The trainer (`relaytrain.run.train`) and the planner (`relaytrain.planner.plan`) drive every strategy
through this interface alone: neither asks for a strategy's name. A new strategy is one
module with a registered subclass, its config file in `configs/strategy/`, and its tests;
registering refuses a class that leaves a question of the contract unanswered.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from relaytrain.cost.model import CostModel
from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.objectives.base import Divisor
from relaytrain.placement.layout import Layout
from relaytrain.placement.world import World
from relaytrain.schema.config import StrategyConfig
from relaytrain.step import metrics
from relaytrain.step.evaluation import EvalStats
from relaytrain.step.precision import Precision
from relaytrain.utils.errors import ConfigError


@dataclass(frozen=True)
class Capabilities:
    """What a strategy can honour; the shared config checks refuse the rest with one line."""

    weight_versions: int = 1  # weight versions a process keeps (2BW: 2)
    grad_clip: bool = True  # global-norm clipping (needs every gradient before any update)
    fp16: bool = True  # fp16 loss scaling (one overflow decision across every weight)
    cross_precision: bool = False  # cmp_*: fp32 masters apart from the half weights computed with
    lowbit_states: bool = True  # optim.state_bits=8|4: torchao's AdamW over the strategy's own parameters
    bf16_masters: bool = False  # optim.master_dtype=bf16: the eager param server's masters in bf16
    # An online objective's policy is the model it holds on the host (L2L's masters), which
    # objective.rollout_placement puts on the device to sample; others sample where the model is.
    host_held_policy: bool = False

    @property
    def update_delay(self) -> int:
        """Steps between the weights a gradient is taken at and the weights it updates: 0 is the
        plain loop's rule; 1 is PipeDream-2BW's W(t+1) = W(t) - lr grad f(W(t-1))."""
        return self.weight_versions - 1


@dataclass
class StepResult:
    loss: float | None  # mean loss of the minibatch (over its loss items); None where this process cannot know it
    skipped: bool = False  # fp16 overflow: no weight changed


class Strategy(ABC):
    name: ClassVar[str] = ""  # set by `register`
    Config: ClassVar[type] = StrategyConfig  # the typed config group: keys no other strategy needs
    capabilities: ClassVar[Capabilities] = Capabilities()
    stop_lag: ClassVar[int] = 1  # steps a process may run ahead of the slowest (see world.StopVotes)
    # Under adapters, whether the frozen base may stay in the checkpoint's half precision in host
    # memory (a strategy that casts what it uploads: L2L); the others compute with the base as it is.
    compact_base: ClassVar[bool] = False
    on_progress: Callable[[str], None] | None = None  # set by the trainer on the reporter: progress inside a step
    # The planner's answers (`cost.model.CostModel`): a class names its cost model's class once
    # (`cost_model = L2LCost`) and gets an instance bound to itself (`__init_subclass__`).
    cost_model: ClassVar[CostModel]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        model = getattr(cls, "cost_model", None)  # its own (a class), or its parent's (bound to the parent)
        model = type(model) if isinstance(model, CostModel) else model
        if isinstance(model, type) and issubclass(model, CostModel) and not model.__abstractmethods__:
            cls.cost_model = model(cls)  # each class its own: a subclass inherits the model, bound to it

    # -- what it needs: class level, no process and no tensor --------------------------------
    @classmethod
    def rank_layout(cls, cfg) -> Layout:
        """Where each process of the run sits (`placement.layout`): its degrees of parallelism
        from the config. One process unless the strategy says otherwise."""
        return Layout()

    @classmethod
    def processes(cls, cfg) -> int:
        """Worker processes a run starts (one launcher starts them all)."""
        return cls.rank_layout(cfg).size

    @classmethod
    def replicas(cls, cfg) -> int:
        """Data-parallel width: each step trains on `replicas` minibatches of the config's shape."""
        return cls.rank_layout(cfg).data_parallel

    @classmethod
    def reporter(cls, cfg) -> int:
        """The rank that knows each step's loss: it shows progress and writes the results."""
        return 0

    @classmethod
    def check_config(cls, cfg) -> None:
        """The strategy's own rules, beyond what its typed config and the shared checks enforce."""

    @classmethod
    def check_device(cls, cfg, device: torch.device) -> None:
        """What the strategy refuses on the device this run would use (the planner's spec-sheet
        GPUs skip this: it is about the machine, not the config)."""

    @classmethod
    def state_layout(cls, cfg) -> dict:
        """How the run's state is split over processes: a checkpoint resumes exactly (RNG streams
        and all) only under the same strategy and state layout; otherwise by parameter name."""
        return {"processes": cls.processes(cfg)}

    @classmethod
    def describe_process(cls, cfg, rank: int) -> str:
        """How messages name process `rank`: its place in the layout ("rank 1 (stage 1 of 2)")."""
        return cls.rank_layout(cfg).describe(rank)

    @classmethod
    def dry_run_stand_in(cls, cfg, rank: int) -> int:
        """The rank whose dry run is this rank's, exactly: the same code on tensors of the same
        shapes, neither depending on the other (a dry run moves nothing between processes), so
        the planner's dry runs (`relaytrain.planner.dryrun.simulate`) run only that one and give this
        rank its figures. A rank another stands in for stands in for itself. Itself unless the
        strategy knows better."""
        return rank

    @classmethod
    def combine_reports(cls, cfg, reports: list[dict]) -> dict:
        """results.json's `strategy_report`, from every process's `report()` (rank order)."""
        return reports[0]

    # -- one process's work -------------------------------------------------------------------
    def __init__(self, model: LayeredModel, cfg, world: World):
        self.model = model
        self.cfg = cfg
        self.world = world
        # The layout is the strategy's, not the World's: the launcher makes the World knowing only
        # a number of processes, and the meshes the layout makes live as long as this run's
        # process groups, which the strategy makes and closes.
        self.layout = self.rank_layout(cfg)
        self.place = self.layout.coordinates(world.rank)  # this process's coordinates
        self.device = world.device
        self.precision = Precision.from_name(str(cfg.precision.name))
        self.timer = metrics.PhaseTimer()  # phases of the measured steps: the trainer resets it after warm-up

    def start(self, step: int) -> None:
        """The run continues from `step` (0, or a checkpoint's): called before `load_state_dict`
        and before the first `step`."""

    @abstractmethod
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        """Forward and backward over every micro-batch of the (global) minibatch, then one update
        of every weight (work that overlaps the next step may finish during it: see `drain`)."""

    def reset_measurements(self) -> None:
        """The untimed steps are over: the figures `report` gives cover the steps from here on
        (the first steps allocate optimizer state and buffers)."""
        self.timer.reset()

    def drain(self) -> None:
        """Finish all work in flight, so that `state_dict`, `weights` and `evaluate` see the
        weights after every step taken. Called by every process at the same step."""

    @abstractmethod
    def evaluate(self, batches: list[list[MicroBatch]]) -> EvalStats | None:
        """Forward only, no gradient state, on the newest weights; the summed figures of every
        process on the reporter (None elsewhere). Called after `drain`."""

    @abstractmethod
    def parameter_names(self) -> list[str]:
        """Hugging Face names of the parameters this process computes with."""

    @abstractmethod
    def state_dict(self) -> dict | None:
        """This process's share of the checkpoint: `weights` and `optimizer` state keyed by Hugging
        Face name, `scaler`, and `extra` (the strategy's own, e.g. a second weight version);
        None when another process holds exactly the same (a replica)."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """The inverse: `weights`/`optimizer` hold (at least) `parameter_names()`; `extra` is
        None when the checkpoint came from another strategy or layout."""

    def sharded_state_dict(self) -> dict | None:
        """State sharded across the processes (tensors split by torch.distributed), keyed by name,
        which every process saves together beside its share; None for a strategy whose shares
        hold all of it."""
        return None

    def load_checkpoint(self, found) -> None:
        """Resume from `found` (a `checkpoint.Checkpoint`): by name from whichever shares (or
        sharded directory) hold this process's parameters."""
        self.load_state_dict(found.state_for(self.parameter_names(), self.world.rank))

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor] | None:
        """Current weights by Hugging Face name, for saving the model; None from a replica."""

    def sum_over_replicas(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (on this process's device) summed in place over the processes whose rows make
        up one minibatch, the group the step's loss is summed over; one process: as they are.
        Called by every such process at the same point of the run, from the trainer's thread."""
        return values

    def loss_term_sums(self) -> dict[str, tuple[float, int]]:
        """`LayeredModel.loss_term_sums` of whichever copies of the model this process computed with."""
        return self.model.loss_term_sums()

    def loss_terms(self) -> dict[str, float]:
        """The terms beside the objective's loss since the last call, each its mean over every
        replica's share (`LayeredModel.loss_term_sums`): on every process that computes a loss
        (called by every process after each step)."""
        sums = self.loss_term_sums()
        if not sums or self.world.simulated:  # a dry run has no values to report
            return {}
        names = sorted(sums)  # every process the same order (the model's names are the run's)
        values = torch.tensor([x for name in names for x in sums[name]], dtype=torch.float64, device=self.device)
        totals = self.sum_over_replicas(values).tolist()
        return {name: total / count for name, total, count in zip(names, totals[::2], totals[1::2], strict=True) if count}

    def report(self) -> dict:
        """This process's figures (JSON-able): phase times, memory, the strategy's own."""
        return {}

    def memory_holders(self) -> dict[str, list]:
        """The device tensors this process holds now, by kind (weights, gradients, optimizer
        state, stash): how a dry run's simulated peak is broken down (memory.DeviceMemory)."""
        return {}

    def simulated_memory(self, tracker) -> dict:
        """memory.device of a dry run's results: what the tracker saw (a strategy whose memory the
        meta device cannot show whole says what it adds, and labels it)."""
        return tracker.figures()

    def progress(self, text: str) -> None:
        """Where the step in flight is, for the user watching a long step (cheap when nobody is)."""
        if self.on_progress is not None:
            self.on_progress(text)

    def close(self) -> None:
        """Release workers, buffers and process groups."""


# --------------------------------------------------------------------------- shared helpers


class ReplicatedStrategy(Strategy):
    """A strategy whose every process is a data-parallel worker: `strategy.replicas` of them,
    each on its share of every micro-batch (the baseline, FSDP, L2L), and with sequence
    parallelism S workers sharing each replica's sequences (R x S in all)."""

    @classmethod
    def rank_layout(cls, cfg) -> Layout:
        return Layout(replicate=cfg.strategy.replicas, sequence=getattr(cfg.strategy, "sequence_parallel", 1))

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.strategy.replicas < 1:
            raise ConfigError(f"strategy.replicas={cfg.strategy.replicas} must be at least 1")

    @classmethod
    def dry_run_stand_in(cls, cfg, rank: int) -> int:
        """Replica 0: every replica runs the same code on an equal share of every micro-batch,
        and in a dry run no gradient or weight passes between them."""
        return 0


def optimizer_tensors(optimizers) -> list[torch.Tensor]:
    return [v for o in optimizers for state in o.state.values() for v in state.values() if torch.is_tensor(v)]


def scalar(t: torch.Tensor) -> float | None:
    """A one-element tensor's value; None in a dry run, where tensors have no values."""
    return None if t.device.type == "meta" else float(t)


def minibatch_divisor(model: LayeredModel, minibatch: list[MicroBatch], replicas: int = 1) -> Divisor:
    """What each micro-batch's loss terms are divided by: the whole minibatch's loss items (every
    replica's rows) and its micro-batches (each replica's share of one counts as one)."""
    return Divisor(items=sum(model.loss_items(mb) for mb in minibatch), microbatches=len(minibatch) * replicas)


def replica_rows(minibatch: list[MicroBatch], replica: int, replicas: int) -> list[MicroBatch]:
    """This replica's share of every micro-batch of a global minibatch (equal consecutive rows),
    keyed as this replica's: each replica draws its own dropout masks for its own rows."""
    if replicas == 1:
        return minibatch
    size = minibatch[0].num_samples // replicas
    rows = slice(replica * size, (replica + 1) * size)
    return [mb.rows(rows, replica) for mb in minibatch]
