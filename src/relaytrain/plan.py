"""`relaytrain plan`: which strategy and shape to train a model with, on a machine, within a
memory limit; and `predict(cfg)`, the same cost model for one config before a run.

PipeDream-2BW's planner (§4, Algorithm 1) over every registered strategy:

1. **Profile** the machine: this one, timed on one block of the configured model, or a GPU
   profile file of spec-sheet figures (`relaytrain.profile`).
2. **Candidates**: every shape each strategy says trains the requested global batch B on the
   workers given (`Strategy.shapes`: the baseline's micro-batch size b and count m = B / b,
   with or without block recompute; L2L's b, inner loop u, replicas w and stash; a pipeline's
   width w x depth d = workers, b, m = B / (w b) and recompute none/block/stage). Micro-batch
   sizes are powers of two.
3. **Time**: each candidate's step by its strategy's cost model (`Strategy.step_cost`, made of
   the shared formulas in `relaytrain.costmodel`).
4. **Host memory**: each candidate's host memory on one machine, estimated from its strategy's
   host state (`Strategy.host_state_bytes`: an eager param server's, offloaded masters and
   optimizer state, a stash on the host) and the fp32 model each worker builds there first,
   against `plan.host_memory_gb` (this machine's RAM for plan.device=this; unlimited for a
   profile unless given): a candidate over it does not fit, whatever its device memory.
5. **Device memory**: each candidate's device memory from the meta-device dry run of the real
   strategy code (`relaytrain.dryrun.simulate`), walking the candidates fastest first until
   the fastest that fits is found, then the fastest that fits of every other strategy and
   variant. A closed-form MEMORY(.) (`Strategy.device_bytes`) prunes obviously hopeless ones
   before they are simulated; a shape whose micro-batch did not fit is not simulated again with
   a larger one (memory only grows with b at a fixed batch).
6. **Answer**: a table, the best candidate that fits, the `relaytrain train` command that runs
   it, and plan.json. Every time figure is a prediction and says so.

Nothing here knows a strategy by name: a registered strategy is planned through its class.
"""

from __future__ import annotations

import copy
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from relaytrain.compose import compose, validate
from relaytrain.costmodel import FP32, ModelFacts, Shape, StepCost, powers_of_two_dividing
from relaytrain.dryrun import simulate
from relaytrain.errors import ConfigError
from relaytrain.files import write_json
from relaytrain.models.pretrained import explicit_overrides, resolve
from relaytrain.preflight import HEADROOM, check_can_start
from relaytrain.profile import Profile, from_spec, load_spec, measure
from relaytrain.strategies import presets, registry, strategy_class
from relaytrain.world import pick_device

GiB = 2**30
PRUNE_FACTOR = 1.5  # closed-form memory above this many budgets: hopeless, not simulated
CUDA_HEADROOM = 0.9  # of a GPU's memory for tensors: the CUDA context and allocator caching take the rest
MAX_SIMULATIONS = 24  # dry runs per plan, at most
MAX_PER_STRATEGY = 4  # dry runs per strategy variant (l2l, l2l stash=cpu), at most
STATE_KINDS = ("weights", "gradients", "optimizer state")  # of a dry run's breakdown: what no b changes
TABLE_ROWS = 24
WIDE = 160  # columns of the table when the output is not a terminal (a file, a pipe)
PLANNER_KEYS = ("strategy", "plan", "hydra")  # override sections the planner decides or consumes
IGNORED_KEYS = ("strategy", "hydra")  # of those, the ones a user's value is dropped from
RUN_DIR_KEY = "hydra.run.dir"  # but this one: where plan.json goes


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True)
class Request:
    """What the user asked: workers, each device's memory, the global batch, the profile,
    strategies, and each machine's host memory (None: unlimited)."""

    workers: int
    memory_bytes: float
    batch: int
    device: str
    strategies: tuple[str, ...]
    threads: int  # train.threads (0: cores shared out)
    host_memory_bytes: float | None = None

    def to_json(self) -> dict:
        host = None if self.host_memory_bytes is None else self.host_memory_bytes / GiB
        return {"workers": self.workers, "device_memory_gb": self.memory_bytes / GiB, "batch_size": self.batch,
                "device": self.device, "strategies": list(self.strategies), "threads": self.threads,
                "host_memory_gb": host}


def read_request(cfg, overrides: list[str], profile_memory: int | None) -> Request:
    p = cfg.plan
    memory_given = any(_key(o) == "plan.device_memory_gb" for o in overrides)
    memory = p.device_memory_gb * GiB if memory_given or profile_memory is None else profile_memory
    batch = p.batch_size or cfg.strategy.microbatch_size * cfg.strategy.num_microbatches
    if p.workers < 1 or memory <= 0 or batch < 1:
        raise ConfigError(f"plan.workers={p.workers}, plan.device_memory_gb={memory / GiB:g} and "
                          f"plan.batch_size={batch} must be positive")
    return Request(p.workers, float(memory), batch, str(p.device), tuple(_strategies(p.strategies)), cfg.train.threads,
                   host_memory_budget(p))


def host_memory_budget(p) -> float | None:
    """Each machine's host memory in bytes: plan.host_memory_gb, else this machine's RAM when
    planning for this machine, else None (unlimited: a profile describes the GPU, not its host)."""
    if p.host_memory_gb < 0:
        raise ConfigError(f"plan.host_memory_gb={p.host_memory_gb:g} must be positive (or 0: this machine's RAM "
                          f"with plan.device=this, unlimited for a profile)")
    if p.host_memory_gb:
        return float(p.host_memory_gb * GiB)
    if str(p.device) == "this":
        import psutil

        return float(psutil.virtual_memory().total)
    return None


def _strategies(asked) -> list[str]:
    """The strategies (or presets) to plan: every registered one unless named."""
    if not asked:
        return list(registry())
    for name in asked:
        strategy_class(name)  # an unknown name: one line with the options
    return [str(name) for name in asked]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _section(override: str) -> str:
    """`strategy` for strategy=l2l and strategy.stages=2, `model` for model.hidden_size=64."""
    return _key(override).split(".")[0].split("/")[0]


def out_dir(overrides: list[str], out: str | None) -> Path:
    """Where plan.json goes: `--out`, else `hydra.run.dir` as a Hydra tool would (its `${now:...}`
    resolved as Hydra resolves it), else outputs/plan/DATE_TIME."""
    if out is not None:
        return Path(out)
    given = [o.split("=", 1)[1] for o in overrides if _key(o) == RUN_DIR_KEY]
    if not given:
        return Path("outputs/plan") / time.strftime("%Y-%m-%d_%H-%M-%S")
    from hydra.core.utils import setup_globals

    setup_globals()  # registers Hydra's `now` resolver
    return Path(str(OmegaConf.create({"dir": given[-1]}).dir))


def passthrough(overrides: list[str]) -> list[str]:
    """The overrides a planned `relaytrain train` command keeps: not strategy.*, plan.* or hydra.*."""
    return [o for o in overrides if _section(o) not in PLANNER_KEYS]


# --------------------------------------------------------------------------- candidates


def enumerate_shapes(request: Request, num_layers: int) -> list[Shape]:
    """Every shape of every requested strategy that trains exactly `request.batch` samples a step
    (a preset: its strategy's shapes that keep the keys it fixes)."""
    shapes = []
    for name in request.strategies:
        cls = strategy_class(name)
        offered = cls.shapes(request.workers, request.batch, num_layers)
        preset = presets().get(name)
        shapes += offered if preset is None else _keeping(offered, preset.fixed, cls)
    return list(dict.fromkeys(shapes))  # a strategy and its preset offer some shapes twice


def _keeping(shapes: list[Shape], fixed: dict, cls) -> list[Shape]:
    """The shapes whose options agree with a preset's fixed keys (among the keys shapes vary)."""
    varied = {key for shape in shapes for key, _ in shape.options}
    wanted = dict(cls.shape_options(**{k: v for k, v in fixed.items() if k in varied}))
    return [shape for shape in shapes if {k: v for k, v in shape.options if k in varied} == wanted]


@dataclass
class Candidate:
    """One shape: its predicted step, its device memory (closed form; simulated once dry-run) and
    whether it fits (None: not decided, the planner stopped before simulating it)."""

    shape: Shape
    cost: StepCost | None = None
    closed_form_bytes: int = 0
    simulated_bytes: int | None = None  # the fullest process's peak from the dry run
    host_state_bytes: int = 0  # CPU plans: L2L's EPS state, in the same memory as the "device"
    host_bytes: int = 0  # host memory of the fullest machine (an estimate: `host_bytes`)
    over_host: bool = False  # refused: host_bytes exceeds plan.host_memory_gb (its device memory cannot save it)
    by_kind: dict = field(default_factory=dict)
    fits: bool | None = None
    why_not: str | None = None

    @property
    def memory_bytes(self) -> int | None:
        return None if self.simulated_bytes is None else self.simulated_bytes + self.host_state_bytes

    @property
    def samples_per_s(self) -> float | None:
        return None if self.cost is None else self.shape.batch / self.cost.step_s

    def to_json(self) -> dict:
        s = self.shape
        return {
            "strategy": s.strategy, "microbatch_size": s.microbatch_size, "num_microbatches": s.num_microbatches,
            "replicas": s.replicas, "stages": s.stages, "recompute": s.recompute, "workers": s.workers,
            "predicted": None if self.cost is None else {"step_time_s": self.cost.step_s,
                                                          "samples_per_s": self.samples_per_s,
                                                          "parts_s": self.cost.parts, "notes": self.cost.notes},
            "closed_form_memory_gb": self.closed_form_bytes / GiB,
            "simulated_memory_gb": None if self.simulated_bytes is None else self.simulated_bytes / GiB,
            "host_state_gb": self.host_state_bytes / GiB,
            "host_memory_gb": self.host_bytes / GiB,
            "simulated_by_kind_gb": {k: v / GiB for k, v in self.by_kind.items()},
            "fits": self.fits, "why_not": self.why_not,
        }


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    request: Request
    profile: Profile
    candidates: list[Candidate]
    kept_overrides: list[str]  # the user's overrides a planned command keeps
    ignored_overrides: list[str]

    @property
    def best(self) -> Candidate | None:
        fitting = [c for c in self.candidates if c.fits]
        return min(fitting, key=lambda c: c.cost.step_s) if fitting else None

    def command(self, candidate: Candidate) -> str:
        return shlex.join(["relaytrain", "train", *self.kept_overrides, *candidate.shape.overrides()])

    def to_json(self) -> dict:
        best = self.best
        return {
            "request": self.request.to_json(),
            "best": None if best is None else {
                "command": self.command(best),
                "strategy": best.shape.strategy, "shape": best.shape.describe(),
                "predicted": {"step_time_s": best.cost.step_s, "samples_per_s": best.samples_per_s,
                              "device_memory_gb": best.memory_bytes / GiB},
            },
            "candidates": [c.to_json() for c in self.candidates],
            "profile": self.profile.to_json(),
            "ignored_overrides": self.ignored_overrides,
            "note": "times are predictions of the cost model over the profile; memory is a meta-device dry run",
        }


def make_plan(overrides: list[str], max_simulations: int = MAX_SIMULATIONS) -> Plan:
    """Plan for these `relaytrain plan` overrides: profile, candidates, times, dry-run memory."""
    cfg = resolve(compose(overrides), explicit_overrides(overrides))
    spec = None if str(cfg.plan.device) == "this" else load_spec(str(cfg.plan.device))
    request = read_request(cfg, overrides, int(spec["memory_gb"] * GiB) if spec else _this_device_memory(cfg))
    kept = passthrough(overrides)
    shapes = enumerate_shapes(request, cfg.model.num_layers)
    bases = {name: resolve(compose([*kept, f"strategy={name}"]), explicit_overrides(kept))
             for name in dict.fromkeys(shape.strategy for shape in shapes)}
    if not shapes:
        raise ConfigError(f"no shape of {', '.join(request.strategies)} trains a batch of {request.batch} on "
                          f"{request.workers} worker(s); a pipeline needs plan.workers >= 2 (and some schedules a batch "
                          f"of at least their depth): raise plan.workers or plan.batch_size")
    sizes = sorted({s.microbatch_size for s in shapes})
    profile = from_spec(spec, cfg, sizes) if spec else measure(cfg, sizes, sorted({s.workers for s in shapes}),
                                                                 _this_device(cfg))
    facts = ModelFacts.of(cfg)
    candidates = [_candidate(shape, bases[shape.strategy], facts, profile, request) for shape in shapes]
    candidates.sort(key=lambda c: (c.cost is None, c.cost.step_s if c.cost else 0.0))
    ignored = [o for o in overrides if _section(o) in IGNORED_KEYS and _key(o) != RUN_DIR_KEY]
    plan = Plan(request, profile, candidates, kept, ignored)
    _decide_memory(plan, bases, max_simulations)
    return plan


def _this_device(cfg):
    device = pick_device(cfg.train.device)
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"plan.device=this profiles a CPU or CUDA device, not train.device={cfg.train.device}")
    return device


def _this_device_memory(cfg) -> int | None:
    import torch

    device = _this_device(cfg)
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _candidate(shape: Shape, base, facts: ModelFacts, profile: Profile, request: Request) -> Candidate:
    """A shape checked as `relaytrain train` would check it (on this machine: also whether it can
    start its workers and hold its host memory), then timed by its strategy's cost model."""
    cls = strategy_class(shape.strategy)
    cfg = candidate_config(base, shape)
    candidate = Candidate(shape, closed_form_bytes=cls.device_bytes(cfg, facts),
                          host_bytes=host_bytes(cls, cfg, facts, profile, shape))
    try:
        validate(cfg)
        if request.device == "this":
            check_can_start(cfg, cls)
    except ConfigError as err:
        candidate.fits, candidate.why_not = False, str(err)
        return candidate
    candidate.cost = cls.step_cost(cfg, facts, profile)
    if profile.device_type == "cpu":  # the host state is in the same memory the dry run counts
        candidate.host_state_bytes = cls.host_state_bytes(cfg, facts)
    budget = request.host_memory_bytes
    if budget is not None and candidate.host_bytes > budget:
        candidate.fits, candidate.over_host = False, True
        candidate.why_not = (f"needs about {candidate.host_bytes / GiB:.1f} GB of host memory a machine (estimate), "
                             f"over plan.host_memory_gb={budget / GiB:g}")
    return candidate


def host_bytes(cls, cfg, facts: ModelFacts, profile: Profile, shape: Shape) -> int:
    """Host memory of the fullest machine, an estimate: each of its workers holds its strategy's
    host state (`host_state_bytes`) or, if larger, the fp32 model it builds there before placing
    it, plus the interpreter and libraries (`preflight.HEADROOM`). The workers of one machine:
    a profile's devices per node, or every worker on this machine's CPU."""
    per_machine = shape.workers if profile.device_type == "cpu" else min(shape.workers, profile.devices_per_node)
    worker = max(facts.params * FP32, cls.host_state_bytes(cfg, facts)) + HEADROOM
    return int(per_machine * worker)


def candidate_config(base, shape: Shape):
    """`base` (the user's config under the shape's strategy) with the shape's keys set."""
    cfg = copy.deepcopy(base)
    for override in shape.overrides()[1:]:
        key, value = override.split("=", 1)
        OmegaConf.update(cfg, key, int(value) if value.isdigit() else value, merge=False)
    return cfg


# --------------------------------------------------------------------------- memory


def _decide_memory(plan: Plan, bases: dict, max_simulations: int) -> None:
    """Dry-run candidates, fastest first, until the fastest that fits is found, then each other
    strategy's fastest that fits, within the dry-run budget; the rest stay undecided (fits None)."""
    budget = plan.request.memory_bytes * (CUDA_HEADROOM if plan.profile.device_type == "cuda" else 1.0)
    walk = MemoryWalk(budget, max_simulations)
    for c in plan.candidates:
        if c.fits is None:
            walk.visit(c, bases[c.shape.strategy])
    if plan.best is None:
        _simulate_smallest(plan, bases, budget)


class MemoryWalk:
    """Decides candidates' memory in the order they are visited (fastest first).

    Two inferences spare dry runs, both sound because at a fixed batch a shape's memory only
    grows with its micro-batch b: a larger b than one that did not fit does not fit either;
    and weights, gradients and optimizer state do not depend on b or on recompute, so when
    they alone exceed the budget no micro-batch of that (strategy, w, d) fits.
    """

    def __init__(self, budget: float, max_simulations: int):
        self.budget, self.max_simulations = budget, max_simulations
        self.too_big: dict[tuple, int] = {}  # (strategy, options, w, d, recompute) -> smallest b that did not fit
        self.state: dict[tuple, int] = {}  # (strategy, options, w, d) -> simulated weights + gradients + optimizer state
        self.runs: dict[str, int] = {}  # dry runs per variant
        self.found: set[str] = set()  # variants with a candidate that fits

    def visit(self, c: Candidate, base) -> None:
        name, family, layout = variant(c.shape), _family(c.shape), _family(c.shape)[:4]
        if name in self.found:
            c.why_not = f"not simulated: a faster {name} candidate fits"
        elif self.state.get(layout, 0) > self.budget:
            c.fits, c.why_not = False, (f"its weights, gradients and optimizer state alone need "
                                        f"{self.state[layout] / GiB:.2f} GB (simulated)")
        elif family in self.too_big and c.shape.microbatch_size > self.too_big[family]:
            c.fits, c.why_not = False, f"a smaller micro-batch (b={self.too_big[family]}) of this shape did not fit"
        elif c.closed_form_bytes > PRUNE_FACTOR * self.budget:
            c.fits, c.why_not = False, (f"closed-form MEMORY(.) {c.closed_form_bytes / GiB:.1f} GB is over "
                                        f"{PRUNE_FACTOR:g} x the budget (not simulated)")
        elif sum(self.runs.values()) >= self.max_simulations or self.runs.get(name, 0) >= MAX_PER_STRATEGY:
            c.why_not = "not simulated: the dry-run budget was spent"
        else:
            self._dry_run(c, base, name, family, layout)

    def _dry_run(self, c: Candidate, base, name: str, family: tuple, layout: tuple) -> None:
        self.runs[name] = self.runs.get(name, 0) + 1
        _simulate(c, base, self.budget)
        if c.fits:
            self.found.add(name)
        elif c.simulated_bytes is not None:
            self.too_big[family] = min(self.too_big.get(family, c.shape.microbatch_size), c.shape.microbatch_size)
            state = sum(c.by_kind.get(kind, 0) for kind in STATE_KINDS)
            self.state[layout] = max(self.state.get(layout, 0), state)


def variant(shape: Shape) -> str:
    """A strategy with the options its shapes vary (l2l, l2l stash=cpu): each gets its own fastest."""
    return " ".join([shape.strategy, *(f"{key}={value}" for key, value in shape.options)])


def _family(shape: Shape) -> tuple:
    """What fixes a shape's memory but for its micro-batch (the first four: but for b and recompute)."""
    return shape.strategy, shape.options, shape.replicas, shape.stages, shape.recompute


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
        c.why_not = f"needs {c.memory_bytes / GiB:.2f} GB (simulated), over {budget / GiB:.2f} GB"


def _simulate_smallest(plan: Plan, bases: dict, budget: float) -> None:
    """Nothing fits: dry-run the candidate the closed form finds smallest, for the one-line answer."""
    valid = [c for c in plan.candidates if c.cost is not None and not c.over_host]
    if valid:
        smallest = min(valid, key=lambda c: c.closed_form_bytes)
        if smallest.simulated_bytes is None:
            _simulate(smallest, bases[smallest.shape.strategy], budget)


def infeasible_line(plan: Plan, where: Path) -> str:
    r = plan.request
    asked = f"nothing fits {r.workers} x {r.memory_bytes / GiB:g} GB for a batch of {r.batch}"
    simulated = [c for c in plan.candidates if c.memory_bytes is not None]
    over_host = [c for c in plan.candidates if c.over_host]
    reasons = []
    if simulated:
        c = min(simulated, key=lambda c: c.memory_bytes)
        reasons.append(f"the smallest dry run, {c.shape.strategy} {c.shape.describe()}, needs "
                       f"{c.memory_bytes / GiB:.2f} GB")
    if over_host:
        c = min(over_host, key=lambda c: c.host_bytes)
        reasons.append(f"{len(over_host)} candidate(s) need more host memory than plan.host_memory_gb="
                       f"{r.host_memory_bytes / GiB:g}, the least {c.shape.strategy} {c.shape.describe()} "
                       f"with {c.host_bytes / GiB:.1f} GB (an estimate)")
    if not reasons:
        refusals = sorted({c.why_not for c in plan.candidates if c.why_not})
        reasons.append(f"every candidate was refused ({refusals[0] if refusals else 'no candidate'})")
    return (f"{asked}: {'; '.join(reasons)}; raise plan.device_memory_gb, plan.host_memory_gb or plan.workers, "
            f"or lower plan.batch_size (every candidate in {where / 'plan.json'})")


# --------------------------------------------------------------------------- output


def write_plan(plan: Plan, out_dir: Path) -> Path:
    return write_json(Path(out_dir) / "plan.json", plan.to_json(), indent=2)


def print_plan(plan: Plan, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=WIDE)
    r, p = plan.request, plan.profile
    console.print(f"profile: {p.device}; {p.source.split(': ')[0]} (details in plan.json)", highlight=False)
    if plan.ignored_overrides:
        console.print(f"ignored (the planner decides these): {' '.join(plan.ignored_overrides)}", highlight=False)
    best = plan.best
    host = "unlimited" if r.host_memory_bytes is None else f"{r.host_memory_bytes / GiB:g} GB"
    table = Table(title=f"relaytrain plan: {r.workers} worker(s) x {r.memory_bytes / GiB:g} GB, host {host} a machine, "
                        f"batch {r.batch} (times predicted; memory simulated, host memory estimated)")
    for column in ("", "strategy", "shape", "step s", "samples/s", "memory GB", "closed form GB", "host GB", "fits",
                   "why not"):
        table.add_column(column, overflow="fold")
    shown = _rows_to_show(plan)
    for c in shown:
        table.add_row("*" if c is best else "", c.shape.strategy, c.shape.describe(),
                      _fmt(c.cost.step_s if c.cost else None, ".3g"), _fmt(c.samples_per_s, ".3g"),
                      _fmt(None if c.memory_bytes is None else c.memory_bytes / GiB, ".2f"),
                      f"{c.closed_form_bytes / GiB:.2f}", f"{c.host_bytes / GiB:.1f}",
                      {True: "yes", False: "no", None: "?"}[c.fits],
                      c.why_not or "")
    console.print(table)
    if len(shown) < len(plan.candidates):
        console.print(f"{len(plan.candidates) - len(shown)} more candidates in {path}", highlight=False)
    for name, why in _refused_variants(plan).items():
        console.print(f"not considered: {name} ({why})", highlight=False)
    if p.device_type == "cpu":
        console.print("CPU: no host<->device transfer; workers share the cores; a row's memory adds the state "
                      "its strategy keeps on the host (an eager param server's: the same memory)", highlight=False)
    console.print(f"best (predicted): {best.shape.strategy} {best.shape.describe()}: {best.cost.step_s:.3g} s a step, "
                  f"{best.samples_per_s:.3g} samples/s, {best.memory_bytes / GiB:.2f} GB of device memory "
                  f"(simulated)", highlight=False)
    console.print(f"run it: {plan.command(best)}", highlight=False, soft_wrap=True)
    console.print(f"wrote {path}", highlight=False)


def _rows_to_show(plan: Plan) -> list[Candidate]:
    """Every candidate whose memory was decided by a dry run, and each variant's fastest of those
    the checks let through (a variant refused whole is one line below the table)."""
    fastest = {}
    for c in plan.candidates:
        if c.cost is not None:
            fastest.setdefault(variant(c.shape), c)
    rows = [c for c in plan.candidates if c.simulated_bytes is not None or fastest.get(variant(c.shape)) is c]
    return rows[:TABLE_ROWS]


def _refused_variants(plan: Plan) -> dict[str, str]:
    """The variants none of whose candidates passed the checks, with the first reason."""
    timed = {variant(c.shape) for c in plan.candidates if c.cost is not None}
    refused: dict[str, str] = {}
    for c in plan.candidates:
        if variant(c.shape) not in timed:
            refused.setdefault(variant(c.shape), c.why_not)
    return refused


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# --------------------------------------------------------------------------- one config


@dataclass(frozen=True)
class Prediction:
    """The cost model's step time for one config on this machine (a prediction), and the dry
    run's device memory where there is a separate device (None on a CPU)."""

    step_time_s: float
    samples_per_s: float
    device_memory_bytes: int | None


def predict(cfg) -> Prediction:
    """Predict `cfg`'s step on this machine with its strategy's cost model, profiling one block
    briefly at the config's micro-batch size (and gloo, when it has several workers). Device
    memory: the meta-device dry run on a CUDA device; None on a CPU (no separate device)."""
    cls, s = strategy_class(cfg.strategy.name), cfg.strategy
    device = _this_device(cfg)
    # Every power of two up to b: the profile stops timing where a block's forward and backward
    # would pass PART_BUDGET_S and extrapolates from there, so a large model costs seconds, not minutes.
    sizes = sorted({*powers_of_two_dividing(s.microbatch_size), s.microbatch_size})
    profile = measure(cfg, sizes, [cls.processes(cfg)], device)
    cost = cls.step_cost(cfg, ModelFacts.of(cfg), profile)
    memory = simulate(cfg).peak_bytes if device.type == "cuda" else None
    batch = s.microbatch_size * s.num_microbatches * cls.replicas(cfg)
    return Prediction(cost.step_s, batch / cost.step_s, memory)
