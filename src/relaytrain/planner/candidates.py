"""The planner's candidates: steps 2 to 5 of `relaytrain plan` (the steps are listed in full in
`relaytrain.planner.plan`, which profiles the machine and calls these).

2. **Candidates**: every shape each strategy says trains the requested global batch B on the
   workers given (`CostModel.shapes`, asked of each strategy's `cost_model`: the baseline's micro-batch size b and count m = B / b,
   with or without block recompute; L2L's b, inner loop u, replicas w and stash; a pipeline's
   width w x depth d = workers, b, m = B / (w b) and recompute none/block/stage). Micro-batch
   sizes are powers of two. Every placement that spreads a replica over several workers is
   asked the same way: the strategy's cost model says which it takes and at which sizes the
   model can take them (`CostModel.degrees`: sequences cut over S workers, blocks split over T
   tensor ranks; each size dividing the workers), and its shapes come again for every
   combination of them that divides the workers (`spreads`), each replica spanning their
   product (`CostModel.placed_shapes`): R x S x T workers in all; but a spread shape the run's
   checks refuse (`CostModel.refusal`: two placements together, FSDP's offload with split
   blocks) is not offered.
3. **Time**: each candidate's step by its strategy's cost model (`CostModel.step_cost`, made of
   the shared formulas in `relaytrain.cost.formulas`).
4. **Host memory**: each candidate's host memory on one machine, estimated from its strategy's
   host state (`CostModel.host_state_bytes`: an eager param server's, offloaded masters and
   optimizer state, a stash on the host) and the fp32 model each worker builds there first,
   against `plan.host_memory_gb` (this machine's RAM for plan.device=this; unlimited for a
   profile unless given): a candidate over it does not fit, whatever its device memory.
5. **Device memory**: each candidate's device memory from the meta-device dry run of the real
   strategy code (`relaytrain.planner.dryrun.simulate`), walking the candidates fastest first until
   the fastest that fits is found, then the fastest that fits of every other strategy and
   variant. A closed-form MEMORY(.) (`CostModel.device_bytes`) prunes obviously hopeless ones
   before they are simulated; a shape whose micro-batch did not fit is not simulated again with
   a larger one (memory only grows with b at a fixed batch).

Nothing here knows a strategy by name: a registered strategy is asked through its class and
the cost model it names (`cost_model`).
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from relaytrain.cost.formulas import ModelFacts, StepCost
from relaytrain.cost.profile import Profile
from relaytrain.cost.reference import ReferenceCost, reference_cost
from relaytrain.cost.rollout import kv_cache_bytes
from relaytrain.cost.shape import DEGREES, Shape
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.sampling import free_between_steps, sampling_for, with_sampling
from relaytrain.run.compose import validate
from relaytrain.run.preflight import HEADROOM, check_can_start, gathered_policy_bytes
from relaytrain.run.resolve import choose
from relaytrain.step.metrics import tokens_per_step
from relaytrain.strategies import presets, strategy_class
from relaytrain.utils.errors import ConfigError
from relaytrain.utils.units import GiB

PRUNE_FACTOR = 1.5  # closed-form memory above this many budgets: hopeless, not simulated
CUDA_HEADROOM = 0.9  # of a GPU's memory for tensors: the CUDA context and allocator caching take the rest
MAX_SIMULATIONS = 24  # dry runs per plan, at most
MAX_PER_STRATEGY = 4  # dry runs per strategy variant (l2l, l2l stash=host), at most
STATE_KINDS = ("weights", "gradients", "optimizer state")  # of a dry run's breakdown: what no b changes


@dataclass(frozen=True)
class Request:
    """What the user asked: workers, each device's memory, the global batch, the profile,
    strategies, each machine's host memory (None: unlimited), the tokens of each sequence, and
    what its objective makes of a sample: its sequences (a preference pair: 2) and whether a
    reference pass precedes training (`cost.reference`)."""

    workers: int
    memory_bytes: float
    batch: int
    device: str
    strategies: tuple[str, ...]
    threads: int  # train.threads (0: cores shared out)
    host_memory_bytes: float | None = None
    seq_len: int = 0  # data.seq_len: what a plan's answer depends on as much as on the batch
    rows_per_item: int = 1  # sequences a sample is (`Objective.rows_per_item`: a preference pair's 2)
    needs_reference: bool = False  # the objective reads a reference's log-probs, computed by a pass first
    sampled: bool = False  # an online objective's rows, sampled each rollout batch: its share is in each step

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step runs through the model: every sequence of the batch's samples."""
        return tokens_per_step(self.batch, self.rows_per_item, self.seq_len)

    def to_json(self) -> dict:
        host = None if self.host_memory_bytes is None else self.host_memory_bytes / GiB
        return {"workers": self.workers, "device_memory_gb": self.memory_bytes / GiB, "batch_size": self.batch,
                "seq_len": self.seq_len, "sequences_per_sample": self.rows_per_item,
                "tokens_per_step": self.tokens_per_step, "device": self.device, "strategies": list(self.strategies),
                "threads": self.threads, "host_memory_gb": host}


# --------------------------------------------------------------------------- candidates


@dataclass
class Offer:
    """The shapes of a request, and why each placement the strategies take but offered at no
    size was not (by strategy key: the first such strategy's reason)."""

    shapes: list[Shape]
    unplaced: dict[str, str]


def enumerate_shapes(request: Request, cfg) -> list[Shape]:
    return offer(request, cfg).shapes


def offer(request: Request, cfg) -> Offer:
    """Every shape of every requested strategy that trains exactly `request.batch` samples a step
    of `cfg`'s model, each replica on one worker or spread by the strategy's placements (a
    preset: its strategy's shapes that keep the keys it fixes), and why a placement a strategy
    takes was offered at no size."""
    family, shapes, unplaced = choose(cfg).family, [], {}
    for name in request.strategies:
        cls = strategy_class(name)
        model, refused = cls.cost_model, Refusals(cls.cost_model, cfg, family)
        taken = model.degrees(cfg, request.workers, family)
        placed = model.variants(cfg, family, [
            shape for degrees in spreads(taken, request.workers)
            for shape in model.placed_shapes(request.workers, request.batch, cfg.model.num_layers, degrees)])
        offered = [shape for shape in placed if not shape.placement or refused(shape) is None]
        preset = presets().get(name)
        offered = offered if preset is None else _keeping(offered, preset.fixed, cls)
        shapes += offered
        for key in taken if request.workers > 1 else ():
            if not any(key in shape.placement for shape in offered):
                why = refused.first(key) or _why_unplaced(model, cfg, family, key, request.workers)
                unplaced.setdefault(key, f"{name}: {why}")
    return Offer(list(dict.fromkeys(shapes)), unplaced)  # a strategy and its preset offer some shapes twice


class Refusals:
    """The run's checks (`CostModel.refusal`) of spread shapes: their placements with their other
    keys (FSDP's offload, its replicas), each set of keys asked once; `None` where they pass."""

    def __init__(self, model, cfg, family):
        self.model, self.cfg, self.family = model, cfg, family
        self.said: dict[tuple, str | None] = {}

    def __call__(self, shape: Shape) -> str | None:
        keys = tuple(tuple(override.removeprefix("strategy.").split("=", 1)) for override in shape.overrides()[1:]
                     if not override.startswith(BATCH_KEYS))
        if keys not in self.said:
            self.said[keys] = self.model.refusal(self.cfg, self.family, **dict(keys))
        return self.said[keys]

    def first(self, key: str) -> str | None:
        """The first refusal of a shape spread by the placement `key`, None if none was refused."""
        return next((why for keys, why in self.said.items() if why and any(k == key for k, _ in keys)), None)


BATCH_KEYS = ("strategy.microbatch_size=", "strategy.num_microbatches=")  # what the checks of a placement never read


def _why_unplaced(model, cfg, family, key: str, workers: int) -> str:
    """Why `model`'s strategy offered `key` at no size: the run's refusal at the smallest."""
    smallest = min(size for size in range(2, workers + 1) if workers % size == 0)
    return model.refusal(cfg, family, **{key: smallest}) or f"no size dividing plan.workers={workers} fits the model"


def spreads(degrees: dict[str, list[int]], workers: int) -> list[dict[str, int]]:
    """Every way to spread a replica that `degrees` (`CostModel.degrees`: each placement's sizes)
    allow on `workers` workers: each placement unused or at one of its sizes, their product
    dividing the workers; by strategy key, the unused left out ({} first: one worker a replica)."""
    keys = list(degrees)
    combinations = itertools.product(*([1, *degrees[key]] for key in keys))
    return [{key: size for key, size in zip(keys, sizes, strict=True) if size > 1}
            for sizes in combinations if workers % math.prod(sizes) == 0]


def _keeping(shapes: list[Shape], fixed: dict, cls) -> list[Shape]:
    """The shapes whose options agree with a preset's fixed keys (among the keys shapes vary)."""
    varied = {key for shape in shapes for key, _ in shape.options}
    wanted = dict(cls.cost_model.shape_options(**{k: v for k, v in fixed.items() if k in varied}))
    return [shape for shape in shapes if {k: v for k, v in shape.options if k in varied} == wanted]


@dataclass
class Candidate:
    """One shape: its predicted step, its device memory (closed form; simulated once dry-run) and
    whether it fits (None: not decided, the planner stopped before simulating it)."""

    shape: Shape
    precision: str = "fp32"  # as this candidate's strategy runs the plan's (`plan.precision_for`)
    cost: StepCost | None = None
    closed_form_bytes: int = 0
    simulated_bytes: int | None = None  # the fullest process's peak from the dry run
    host_state_bytes: int = 0  # CPU plans: L2L's EPS state, in the same memory as the "device"
    host_bytes: int = 0  # host memory of the fullest machine (an estimate: `host_bytes`)
    over_host: bool = False  # refused: host_bytes exceeds plan.host_memory_gb (its device memory cannot save it)
    by_kind: dict = field(default_factory=dict)
    fits: bool | None = None
    why_not: str | None = None
    tokens_per_step: int = 0  # every sequence of the batch (`Request.tokens_per_step`)
    reference: ReferenceCost | None = None  # the reference pass before training, where the objective has one
    kv_cache_bytes: int | None = None  # an online objective's: sampling a micro-batch's completions (`cost.rollout`)

    @property
    def memory_bytes(self) -> int | None:
        return None if self.simulated_bytes is None else self.simulated_bytes + self.host_state_bytes

    @property
    def samples_per_s(self) -> float | None:
        """Samples a second: a preference pair is one sample."""
        return None if self.cost is None else self.shape.batch / self.cost.step_s

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens a second, every sequence of a sample counted (both rows of a pair)."""
        return None if self.cost is None else self.tokens_per_step / self.cost.step_s

    def to_json(self) -> dict:
        s = self.shape
        return {
            "strategy": s.strategy, "microbatch_size": s.microbatch_size, "num_microbatches": s.num_microbatches,
            "replicas": s.replicas, "stages": s.stages, **{key: getattr(s, key) for key in DEGREES},
            "recompute": s.recompute, "workers": s.workers,
            "precision": self.precision,
            "predicted": None if self.cost is None else {"step_time_s": self.cost.step_s,
                                                          "samples_per_s": self.samples_per_s,
                                                          "tokens_per_s": self.tokens_per_s,
                                                          "parts_s": self.cost.parts, "notes": self.cost.notes},
            "reference_pass": None if self.reference is None else reference_json(self.reference),
            "sampling_kv_cache_gb": None if self.kv_cache_bytes is None else self.kv_cache_bytes / GiB,
            "closed_form_memory_gb": self.closed_form_bytes / GiB,
            "simulated_memory_gb": None if self.simulated_bytes is None else self.simulated_bytes / GiB,
            "host_state_gb": self.host_state_bytes / GiB,
            "host_memory_gb": self.host_bytes / GiB,
            "simulated_by_kind_gb": {k: v / GiB for k, v in self.by_kind.items()},
            "fits": self.fits, "why_not": self.why_not,
        }


def check_candidate(shape: Shape, base, facts: ModelFacts, profile: Profile, request: Request, device) -> Candidate:
    """A shape checked as `relaytrain train` would check it (on this machine's `device`: also
    whether it can start its workers and hold its host memory), then timed by its strategy's
    cost model; where the objective has a reference pass, its closed form held against the
    device and the host as well (it runs before training: the larger of the two counts)."""
    cls = strategy_class(shape.strategy)
    cfg, model = candidate_config(base, shape), cls.cost_model
    reference = reference_cost(facts, profile, shape.microbatch_size, shape.microbatch_size * shape.num_microbatches,
                               request.threads) if request.needs_reference else None
    candidate = Candidate(shape, str(cfg.precision.name), closed_form_bytes=model.device_bytes(cfg, facts),
                          host_bytes=host_bytes(cls, cfg, facts, profile, shape, reference),
                          tokens_per_step=request.tokens_per_step, reference=reference)
    try:
        validate(cfg)
        if request.device == "this":
            check_can_start(cfg, cls, device)
    except ConfigError as err:
        candidate.fits, candidate.why_not = False, str(err)
        return candidate
    free = free_between_steps(device_budget(request, profile), facts)
    candidate.cost = with_sampling(model.step_cost(cfg, facts, profile),
                                   sampling_for(cfg, cls, facts, profile, shape.workers, free), cfg)
    if request.sampled:
        candidate.kv_cache_bytes = kv_cache_bytes(facts, shape.microbatch_size * request.rows_per_item, request.seq_len)
    if profile.device_type == "cpu":  # the host state is in the same memory the dry run counts
        candidate.host_state_bytes = model.host_state_bytes(cfg, facts)
    budget = request.host_memory_bytes
    if budget is not None and candidate.host_bytes > budget:
        candidate.fits, candidate.over_host = False, True
        candidate.why_not = (f"needs about {candidate.host_bytes / GiB:.1f} GiB of host memory a machine (estimate), "
                             f"over plan.host_memory_gb={budget / GiB:g}")
    elif reference is not None and reference.device_bytes > device_budget(request, profile):
        candidate.fits = False
        candidate.why_not = (f"its reference pass needs {reference.device_bytes / GiB:.2f} GiB of device memory "
                             f"(closed form), over {device_budget(request, profile) / GiB:.2f} GiB")
    return candidate


def host_bytes(cls, cfg, facts: ModelFacts, profile: Profile, shape: Shape, reference: ReferenceCost | None = None
               ) -> int:
    """Host memory of the fullest machine, an estimate: each of its workers holds its strategy's
    host state (`host_state_bytes`) or, if larger, the model it builds there before placing it
    (fp32; an adapter's frozen base in the checkpoint's dtype where the strategy keeps it so; a
    4-bit base at its peak while it is quantized, `ModelFacts.build_peak_bytes`), plus the
    interpreter and libraries (`preflight.HEADROOM`). The workers of one machine: a profile's
    devices per node, or every worker on this machine's CPU. An online objective's first worker
    holds the whole model too where shards or stages split it (`gathered_policy_bytes`). A
    `reference` pass runs alone before them, the model as built in one process: the larger of
    the two."""
    per_machine = shape.workers if profile.device_type == "cpu" else min(shape.workers, profile.devices_per_node)
    worker = max(facts.build_peak_bytes(cls.compact_base), cls.cost_model.host_state_bytes(cfg, facts)) + HEADROOM
    before = 0 if reference is None else reference.host_bytes + HEADROOM
    gathered = gathered_policy_bytes(cfg, cls, facts.stage_params(facts.num_layers, embed=True, head=True))
    return int(max(per_machine * worker + gathered, before))


def reference_json(reference: ReferenceCost) -> dict:
    """plan.json's reference pass: the figures, in GiB, and what they are."""
    return {"seconds_per_1000_samples": 1000 * reference.seconds_per_item, "group": reference.group,
            "device_memory_gb": reference.device_bytes / GiB, "host_memory_gb": reference.host_bytes / GiB,
            "note": "once before training (then cached): predicted time, closed-form device memory, estimated host"}


def candidate_config(base, shape: Shape):
    """`base` (the user's config under the shape's strategy) with the shape's keys set."""
    cfg = copy.deepcopy(base)
    for override in shape.overrides()[1:]:
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key, int(value) if value.isdigit() else value, merge=False)
    return cfg


# --------------------------------------------------------------------------- device memory


def decide_memory(candidates: list[Candidate], bases: dict, request: Request, profile: Profile,
                  max_simulations: int) -> None:
    """Dry-run candidates (sorted fastest first), until the fastest that fits is found, then each
    other strategy's fastest that fits, within the dry-run budget; the rest stay undecided (fits None)."""
    budget = device_budget(request, profile)
    walk = MemoryWalk(budget, max_simulations)
    for c in candidates:
        if c.fits is None:
            walk.visit(c, bases[c.shape.strategy])
    if not any(c.fits for c in candidates):
        _simulate_smallest(candidates, bases, budget)


def device_budget(request: Request, profile: Profile) -> float:
    """Device memory a candidate's tensors may take: the request's, less the CUDA context's share."""
    return request.memory_bytes * (CUDA_HEADROOM if profile.device_type == "cuda" else 1.0)


class MemoryWalk:
    """Decides candidates' memory in the order they are visited (fastest first).

    Two inferences spare dry runs, both sound because at a fixed batch a shape's memory only
    grows with its micro-batch b: a larger b than one that did not fit does not fit either;
    and weights, gradients and optimizer state do not depend on b or on recompute, so when
    they alone exceed the budget no micro-batch of that (strategy, w, d) fits.
    """

    def __init__(self, budget: float, max_simulations: int):
        self.budget, self.max_simulations = budget, max_simulations
        self.too_big: dict[tuple, int] = {}  # (strategy, options, w, d, S/T, recompute) -> smallest b that did not fit
        self.state: dict[tuple, int] = {}  # (strategy, options, w, d, S/T) -> simulated weights + gradients + optimizer state
        self.runs: dict[str, int] = {}  # dry runs per variant
        self.found: set[str] = set()  # variants with a candidate that fits

    def visit(self, c: Candidate, base) -> None:
        name, footprint = variant(c.shape), _footprint(c.shape)
        state_key = footprint[:-1]
        if name in self.found:
            c.why_not = f"not simulated: a faster {name} candidate fits"
        elif self.state.get(state_key, 0) > self.budget:
            c.fits, c.why_not = False, (f"its weights, gradients and optimizer state alone need "
                                        f"{self.state[state_key] / GiB:.2f} GiB (simulated)")
        elif footprint in self.too_big and c.shape.microbatch_size > self.too_big[footprint]:
            c.fits, c.why_not = False, f"a smaller micro-batch (b={self.too_big[footprint]}) of this shape did not fit"
        elif c.closed_form_bytes > PRUNE_FACTOR * self.budget:
            c.fits, c.why_not = False, (f"closed-form MEMORY(.) {c.closed_form_bytes / GiB:.1f} GiB is over "
                                        f"{PRUNE_FACTOR:g} x the budget (not simulated)")
        elif sum(self.runs.values()) >= self.max_simulations or self.runs.get(name, 0) >= MAX_PER_STRATEGY:
            c.why_not = "not simulated: the dry-run budget was spent"
        else:
            self._dry_run(c, base, name, footprint, state_key)

    def _dry_run(self, c: Candidate, base, name: str, footprint: tuple, state_key: tuple) -> None:
        self.runs[name] = self.runs.get(name, 0) + 1
        _simulate(c, base, self.budget)
        if c.fits:
            self.found.add(name)
        elif c.simulated_bytes is not None:
            self.too_big[footprint] = min(self.too_big.get(footprint, c.shape.microbatch_size), c.shape.microbatch_size)
            state = sum(c.by_kind.get(kind, 0) for kind in STATE_KINDS)
            self.state[state_key] = max(self.state.get(state_key, 0), state)


def variant(shape: Shape) -> str:
    """A strategy with the options its shapes vary (l2l, l2l stash=host) and its placements (l2l
    sequence_parallel=2, baseline tensor_parallel=4): each gets its own fastest."""
    spread = [f"{key}={degree}" for key, degree in shape.placement.items()]
    return " ".join([shape.strategy, *spread, *(f"{key}={value}" for key, value in shape.options)])


def _footprint(shape: Shape) -> tuple:
    """What fixes a shape's memory but for its micro-batch (all but the last, its state key: but
    for b and recompute). Not a model family, nor a `strategy.layout`."""
    spread = tuple(shape.placement.items())
    return shape.strategy, shape.options, shape.replicas, shape.stages, spread, shape.recompute


def _simulate(c: Candidate, base, budget: float) -> None:
    try:
        simulation = simulate(candidate_config(base, c.shape), steps=2)
    except ConfigError as err:  # e.g. a dataset smaller than the batch: the real run would stop the same way
        c.fits, c.why_not = False, str(err)
        return
    fullest = max(simulation.per_process, key=lambda p: p.peak_bytes)
    c.simulated_bytes, c.by_kind = simulation.peak_bytes, dict(fullest.by_kind)
    c.fits = c.memory_bytes <= budget
    if not c.fits:
        c.why_not = f"needs {c.memory_bytes / GiB:.2f} GiB (simulated), over {budget / GiB:.2f} GiB"


def _simulate_smallest(candidates: list[Candidate], bases: dict, budget: float) -> None:
    """Nothing fits: dry-run the candidate the closed form finds smallest, for the one-line answer."""
    valid = [c for c in candidates if c.cost is not None and not c.over_host]
    if valid:
        smallest = min(valid, key=lambda c: c.closed_form_bytes)
        if smallest.simulated_bytes is None:
            _simulate(smallest, bases[smallest.shape.strategy], budget)
