"""A strategy's cost model: every answer the planner (and the pre-run checks) asks of a way of
training before any process exists, in closed form.

Each strategy names its cost model's class once (`cost_model = L2LCost`); every strategy class
gets its own instance, bound to it (`Strategy.__init_subclass__`: `L2L.cost_model.strategy is
L2L`), so one model serves several strategies that differ only in what the class says (the
pipelines' schedule, chunks and stage blocks). Registering refuses a strategy without a cost
model, or with one that leaves `shapes`, `step_cost` or `device_bytes` unanswered. Every way of
spreading a replica over several workers (cutting sequences, splitting blocks) is asked of it
the same way: which sizes it takes (`degrees`) and the shapes with them (`placed_shapes`); what
divides the replicas instead (the baseline's shared experts) is a shape's option (`variants`).
The closed forms read the degrees from `cfg` as a run does.

`cfg` below is a whole config with the shape's keys set (`candidates.candidate_config`), so a
cost model reads the keys the run reads; `facts` the model's sizes; `profile` the machine.
Every figure is a prediction, composed from `cost.formulas`' shared formulas.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from abc import ABC, abstractmethod

from omegaconf import OmegaConf

from relaytrain.cost.formulas import FP32, ModelFacts, StepCost, cpu_activation_bytes
from relaytrain.cost.profile import Profile
from relaytrain.cost.shape import Shape
from relaytrain.models import what_trains
from relaytrain.step.optim import state_words
from relaytrain.utils.errors import ConfigError


def weights_grads_optimizer_bytes(cfg, num_params: int) -> int:
    """fp32 weights, and the gradients and optimizer state of what trains (under adapters: theirs)."""
    trains = what_trains(cfg.model, cfg.adapter)
    trained = num_params if trains is None else trains.parameters
    return num_params * FP32 + trained * FP32 * (1 + state_words(cfg.optim))


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

    def degrees(self, cfg, workers: int, family) -> dict[str, list[int]]:
        """The placements that spread one of this strategy's replicas over several workers
        (`cost.shape.DEGREES`: sequence_parallel, tensor_parallel), each with its sizes above 1
        that divide `workers` and that a run of `cfg`'s model (of `family`, the run's resolved
        `models.family.Family`) takes: what the planner combines with replicas (`placed_shapes`).
        A placement's cost model adds its own to its parent's (`{**super().degrees(...), key:
        sizes}`); none here."""
        return {}

    def refusal(self, cfg, family, **keys) -> str | None:
        """The one line a run of `cfg` under this strategy, its defaults but for `keys`
        (tensor_parallel=4), is refused with by the strategy's own checks (`check_config`); None
        where they let it through. No size a run would refuse is offered (`degrees`), and the
        plan says why a placement was offered at no size with it. A placement's cost model adds
        the checks its run makes of the built model."""
        node = OmegaConf.structured(self.strategy.Config)
        for key, value in keys.items():
            node[key] = value  # checked and converted as a run's override is ("2", "host")
        trial = copy.deepcopy(cfg)
        OmegaConf.update(trial, "strategy", node, merge=False)
        try:
            self.strategy.check_config(trial)
        except ConfigError as refused:
            return str(refused)
        return None

    def variants(self, cfg, family, shapes: list[Shape]) -> list[Shape]:
        """`shapes` and the variants of them that only `cfg`'s model allows (the baseline: its
        replicas sharing a mixture's experts); each variant passes the run's checks (`refusal`).
        None here."""
        return shapes

    def placed_shapes(self, workers: int, batch: int, num_layers: int, degrees: dict[str, int]) -> list[Shape]:
        """The shapes whose replicas each span the product P of `degrees` workers (R x P <=
        `workers`), those degrees set: the strategy's shapes on `workers` // P replicas
        (`shapes_to_place`); with no degree, its `shapes`."""
        spread = math.prod(degrees.values())
        if spread == 1:
            return self.shapes(workers, batch, num_layers)
        return [dataclasses.replace(shape, **degrees)
                for shape in self.shapes_to_place(workers // spread, batch, num_layers, degrees)]

    def shapes_to_place(self, replicas: int, batch: int, num_layers: int, degrees: dict[str, int]) -> list[Shape]:
        """The shapes on at most `replicas` replicas that `placed_shapes` spreads by `degrees`:
        the strategy's own `shapes` (FSDP's start at one replica where the spread shards)."""
        return self.shapes(replicas, batch, num_layers)

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
