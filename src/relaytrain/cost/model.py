"""A strategy's cost model: every answer the planner (and the pre-run checks) asks of a way of
training before any process exists, in closed form.

Each strategy names its cost model's class once (`cost_model = L2LCost`); every strategy class
gets its own instance, bound to it (`Strategy.__init_subclass__`: `L2L.cost_model.strategy is
L2L`), so one model serves several strategies that differ only in what the class says (the
pipelines' schedule, chunks and stage blocks). Registering refuses a strategy without a cost
model, or with one that leaves `shapes`, `step_cost` or `device_bytes` unanswered.

`cfg` below is a whole config with the shape's keys set (`candidates.candidate_config`), so a
cost model reads the keys the run reads; `facts` the model's sizes; `profile` the machine.
Every figure is a prediction, composed from `cost.formulas`' shared formulas.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

from relaytrain.cost.formulas import (
    ModelFacts,
    Shape,
    StepCost,
    cpu_activation_bytes,
    weights_grads_optimizer_bytes,
)
from relaytrain.cost.profile import Profile


class CostModel(ABC):
    """The planner's questions, answered for `strategy` (a strategy class)."""

    def __init__(self, strategy: type):
        self.strategy = strategy

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.strategy.__qualname__})"

    @abstractmethod
    def shapes(self, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """Every shape of the strategy that trains `batch` samples a step on at most `workers`
        workers (devices) for a model of `num_layers` blocks: what the planner may try."""

    def cut_shapes(self, workers: int, batch: int, num_layers: int, size: int) -> list[Shape]:
        """The shapes whose replicas each cut their sequences over `size` workers
        (`strategy.sequence_parallel`; R x S <= `workers`): none for a strategy that cannot
        (`strategies.sequence_parallel.CutSequenceCost` offers them)."""
        return []

    @abstractmethod
    def step_cost(self, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """The predicted step time on `profile`'s machine, composed from the shared formulas of
        `relaytrain.cost.formulas` and the profile's per-part times."""

    @abstractmethod
    def device_bytes(self, cfg, facts: ModelFacts) -> int:
        """Closed-form device memory of the fullest worker (weights, gradients, optimizer state,
        activations): prunes hopeless candidates before the dry run, and is shown beside it."""

    def host_state_bytes(self, cfg, facts: ModelFacts) -> int:
        """State one worker keeps in host memory apart from the device's (an eager param server's
        masters and optimizer state); on a CPU it is the same memory the dry run counts."""
        return 0

    def estimate_host_bytes(self, cfg, num_params: int, device_type: str) -> int:
        """Host memory of the whole run (every process), an estimate that errs high: what the
        pre-launch check (`preflight`) holds against the machine's memory."""
        return weights_grads_optimizer_bytes(cfg, num_params) + cpu_activation_bytes(
            cfg, device_type, live_blocks=cfg.model.num_layers)

    def recomputes(self, cfg) -> bool:
        """Whether backward recomputes the forward (a FLOP estimate counts it once more)."""
        return False

    def shape_options(self, **keys) -> tuple[tuple[str, str], ...]:
        """The strategy keys of a shape that differ from the strategy's defaults: what its
        command must set beyond the micro-batches, replicas, stages and recompute."""
        defaults = {f.name: f.default for f in dataclasses.fields(self.strategy.Config)}
        return tuple((key, str(value)) for key, value in keys.items() if str(value) != str(defaults.get(key)))
