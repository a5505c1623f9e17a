"""What a run is, resolved once: the names a config gives, turned into the things they name.

A config names its strategy, model family, objective and data source by string; each name has
one registry that answers for it. `describe_run` looks every name up once, after the config is
checked and before any process starts, and derives what the processes would otherwise each
derive again from the config (how many processes, which replica counts, who reports). Every
process receives the same frozen `RunSpec` with the config, and asks it rather than a registry.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from relaytrain.data.sources import DataSource, source
from relaytrain.models import family_spec
from relaytrain.objectives import objective
from relaytrain.strategies import strategy_class

if TYPE_CHECKING:
    from relaytrain.models.family import FamilySpec
    from relaytrain.objectives.base import Objective
    from relaytrain.strategies.base import Strategy


@dataclass(frozen=True)
class RunSpec:
    """A run's strategy class, model family, objective and data source, and the shape facts the
    strategy decides from the config (the same in every process)."""

    strategy: type[Strategy]
    family: FamilySpec
    objective: Objective
    source: type[DataSource]
    processes: int  # every process the strategy runs (workers included)
    replicas: int  # copies of the model that each take their share of a minibatch
    reporter: int  # the rank that writes results.json
    benchmark_task: str | None  # the GLUE task a run's evaluation scores as, None for other data
    minibatch_samples: int  # samples a step trains on, over every replica

    @property
    def name(self) -> str:
        return self.strategy.name

    def __reduce__(self):
        # A worker receives the spec pickled: the family and objective travel as the names their
        # registries know them by (a family spec holds functions, which do not pickle).
        names = {"family": self.family.name, "objective": self.objective.name}
        facts = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in names}
        return _looked_up, (names, facts)


def _looked_up(names: dict, facts: dict) -> RunSpec:
    return RunSpec(family=family_spec(names["family"]), objective=objective(names["objective"]), **facts)


def describe_run(cfg) -> RunSpec:
    """The run `cfg` describes, every name looked up once (a checked config: an unknown name was
    refused in one line before this)."""
    cls, data = strategy_class(cfg.strategy.name), source(cfg.data.source)
    replicas = cls.replicas(cfg)
    s = cfg.strategy
    return RunSpec(
        strategy=cls, family=family_spec(cfg.model.family), objective=objective(cfg.model.task),
        source=data, processes=cls.processes(cfg), replicas=replicas,
        reporter=cls.reporter(cfg), benchmark_task=data.benchmark_task(cfg),
        minibatch_samples=s.microbatch_size * s.num_microbatches * replicas,
    )
