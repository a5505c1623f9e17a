"""What a run is, resolved once: the names a config gives, turned into the things they name.

A config names its strategy, model family, objective, data source and precision by string; each
name has one registry that answers for it. Right after composition (and `models.pretrained.resolve`,
which writes a pretrained checkpoint's own keys in), `choose` looks every name up once: the
cross-key checks, the data layer and the model builder receive what it found (`Choices`), never
a name to look up again. After the checks, `describe_run` adds what the processes would
otherwise each derive again from the config, asking each layer once, top to bottom: the strategy
(how many processes, which replica counts, who reports, how the checkpoint is laid out, what
each process is called), the cost model (the model's FLOPs), the records (the checkpoint's
identity, the experiment trackers log.* asks for), the model builder (its parameters, those that
train, a mixture's experts an adapter leaves frozen), and the schedule and schema's plain
values. Every process receives the same frozen `RunSpec` beside the config, and asks it rather
than a registry or a lower layer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from relaytrain.cost.work import model_flops_per_token
from relaytrain.data.sources import DataSource, source
from relaytrain.models import Trains, count_parameters, what_trains
from relaytrain.models.family import family_spec
from relaytrain.objectives import objective
from relaytrain.records import checkpoint
from relaytrain.records.trackers import check_trackers
from relaytrain.run.reference import ReferencePass
from relaytrain.schema.config import untimed_steps
from relaytrain.step.optim import Schedule
from relaytrain.step.precision import Precision
from relaytrain.strategies import strategy_class

if TYPE_CHECKING:
    from relaytrain.models.family import Family
    from relaytrain.objectives.base import Objective
    from relaytrain.strategies.base import Strategy


@dataclass(frozen=True)
class Choices:
    """What the config's names name: its strategy class, model family, objective, data source
    and precision."""

    strategy: type[Strategy]
    family: Family
    objective: Objective
    source: type[DataSource]
    precision: Precision

    def __reduce__(self):
        # A worker receives the spec pickled: the family and objective travel as the names their
        # registries know them by (a family spec holds functions, which do not pickle).
        # The objective takes its objective.* keys along.
        names = {"family": self.family.name, "objective": (self.objective.name, self.objective.settings)}
        facts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in names}
        return _looked_up, (type(self), names, facts)


def _looked_up(kind: type, names: dict, facts: dict) -> Choices:
    name, settings = names["objective"]
    chosen = objective(name)
    return kind(family=family_spec(names["family"]), objective=chosen.configured(settings) if settings else chosen,
                **facts)


@dataclass(frozen=True)
class RunSpec(Choices):
    """The run's `Choices` and the facts every process would otherwise derive from the config
    again (the same in every process)."""

    processes: int  # every process the strategy runs (workers included)
    replicas: int  # copies of the model that each take their share of a minibatch
    reporter: int  # the rank that writes results.json
    benchmark_task: str | None  # the GLUE task a run's evaluation scores as, None for other data
    minibatch_samples: int  # samples a step trains on, over every replica
    layout: dict  # how the run's state is split over processes (a checkpoint's `layout`)
    process_names: tuple[str, ...]  # what errors and results.json call each process, by rank
    flops_per_token: float  # the model's training FLOPs a token (`cost.work.model_flops_per_token`)
    identity: dict  # what a checkpoint must match to resume this run (`records.checkpoint.identity`)
    trackers: dict  # the experiment trackers log.* asks for, checked, with their settings (`records.trackers`)
    parameters: int  # the model's parameters (results.json, the host memory estimate)
    trains: Trains | None  # what trains under an adapter, as peft builds the model (None: every parameter)
    schedule: Schedule  # the learning rate at each optimizer update (optim.*, train.steps)
    untimed_steps: int  # steps left out of the throughput figures (`schema.config.untimed_steps`)
    reference: ReferencePass | None  # a preference objective's reference pass (`run.reference`), else None

    @property
    def name(self) -> str:
        return self.strategy.name


def choose(cfg) -> Choices:
    """Every name of `cfg` looked up once; an unknown one is one line naming those there are."""
    return Choices(strategy=strategy_class(cfg.strategy.name), family=family_spec(cfg.model.family),
                   objective=objective(cfg.objective.name, _objective_key(cfg.objective.name, cfg.model.task)).configured(objective_keys(cfg)), source=source(cfg.data.source),
                   precision=Precision.from_name(str(cfg.precision.name)))


def _objective_key(name: str, task: str) -> str:
    """The key that named the objective, for a message: model.task where objective.name is its default."""
    return "model.task" if name == task else "objective.name"


def objective_keys(cfg) -> dict:
    """objective.* but its name, as plain values: what a configured objective takes."""
    keys = OmegaConf.to_container(cfg.objective, resolve=True)
    return {key: value for key, value in keys.items() if key != "name"}


def describe_run(cfg, chosen: Choices | None = None) -> RunSpec:
    """The run `cfg` describes (a checked config), from what `choose` found (looked up here
    when not given): each layer asked once, top to bottom (the strategy; the cost model; the
    records; the model builder, for the run's family and objective), then the plain values."""
    chosen = chosen or choose(cfg)
    reference = ReferencePass.of(cfg, chosen)
    cls, m, s, t, o = chosen.strategy, cfg.model, cfg.strategy, cfg.train, cfg.optim
    processes, replicas = cls.processes(cfg), cls.replicas(cfg)
    return RunSpec(
        **{f.name: getattr(chosen, f.name) for f in fields(Choices)}, reference=reference,
        processes=processes, replicas=replicas, reporter=cls.reporter(cfg), layout=cls.state_layout(cfg),
        process_names=tuple(cls.describe_process(cfg, rank) for rank in range(processes)),
        flops_per_token=model_flops_per_token(m, cfg.data.seq_len),
        identity=checkpoint.identity(cfg), trackers=check_trackers(cfg.log),
        parameters=count_parameters(m, chosen.family, chosen.objective),
        trains=what_trains(m, cfg.adapter, chosen.family, chosen.objective),
        benchmark_task=chosen.source.benchmark_task(cfg.data.name),
        minibatch_samples=s.microbatch_size * s.num_microbatches * replicas,
        schedule=Schedule(o.lr, o.warmup_steps, str(o.schedule), t.steps),
        untimed_steps=untimed_steps(t.untimed_steps, t.steps),
    )


def minibatch_samples(cfg, cls: type[Strategy]) -> int:
    """Samples a step of `cfg` trains on under strategy `cls`, over every replica."""
    s = cfg.strategy
    return s.microbatch_size * s.num_microbatches * cls.replicas(cfg)
