"""`relaytrain plan`: which strategy and shape to train a model with, on a machine, within a
memory limit; and `predict(cfg)`, the same cost model for one config before a run.

PipeDream-2BW's planner (§4, Algorithm 1) over every registered strategy:

1. **Profile** the machine: this one, timed on one block of the configured model, or a GPU
   profile file of spec-sheet figures (`relaytrain.cost.profile`).
2.-5. **Candidates**: every shape each strategy offers for the request, checked, timed by its
   cost model, its host memory estimated and its device memory decided by the meta-device dry
   run, fastest first (`relaytrain.planner.candidates`).
6. **Answer**: a table, the best candidate that fits, the `relaytrain train` command that runs
   it, and plan.json (`relaytrain.planner.output`).

Nothing here knows a strategy by name: a registered strategy is planned through its class.
"""

from __future__ import annotations

import shlex
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from relaytrain.cost.formulas import ModelFacts, powers_of_two_dividing
from relaytrain.cost.profile import Profile, from_spec, load_spec, measure
from relaytrain.models import adapter, hf_config
from relaytrain.models.pretrained import explicit_overrides, resolve
from relaytrain.placement.world import pick_device
from relaytrain.planner.candidates import (
    MAX_SIMULATIONS,
    Candidate,
    GiB,
    Request,
    check_candidate,
    decide_memory,
    offer,
    reference_json,
)
from relaytrain.planner.dryrun import simulate
from relaytrain.planner.sampling import free_between_steps, sampling_for, time_decode, with_sampling
from relaytrain.run.compose import compose
from relaytrain.run.launch import keep_freed_host_memory
from relaytrain.run.resolve import choose
from relaytrain.step.lowbit import check_available, state_bits
from relaytrain.step.metrics import sequences
from relaytrain.strategies import registry, strategy_class
from relaytrain.utils.errors import ConfigError

PLANNER_KEYS = ("strategy", "plan", "hydra")  # override sections the planner decides or consumes
IGNORED_KEYS = ("strategy", "hydra")  # of those, the ones a user's value is dropped from
RUN_DIR_KEY = "hydra.run.dir"  # but this one: where plan.json goes
PRECISION_KEY = "precision"  # the plan's precision: each candidate's command carries its own
DECODER_ON_A_GPU = "cmp_bf16"  # a decoder's precision on a GPU profile unless given
CHECKPOINT = "CHECKPOINT"  # a planned command's model.pretrained where the plan stood a shape in for it


# --------------------------------------------------------------------------- the request


def read_request(cfg, overrides: list[str], profile_memory: int | None) -> Request:
    p = cfg.plan
    memory_given = any(_key(o) == "plan.device_memory_gb" for o in overrides)
    memory = p.device_memory_gb * GiB if memory_given or profile_memory is None else profile_memory
    batch = p.batch_size or cfg.strategy.microbatch_size * cfg.strategy.num_microbatches
    if p.workers < 1 or memory <= 0 or batch < 1:
        raise ConfigError(f"plan.workers={p.workers}, plan.device_memory_gb={memory / GiB:g} and "
                          f"plan.batch_size={batch} must be positive")
    goal = choose(cfg).objective  # a preference pair is two sequences, and its reference is a pass of its own
    return Request(p.workers, float(memory), batch, str(p.device), tuple(_strategies(p.strategies)), cfg.train.threads,
                   host_memory_budget(p), cfg.data.seq_len, goal.rows_per_item, goal.needs_reference,
                   goal.learns_online)


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


BATCH_KEYS = ("plan.batch_size", "strategy.microbatch_size", "strategy.num_microbatches")  # the user chose a batch


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
    """The overrides a planned `relaytrain train` command keeps: not strategy.*, plan.* or hydra.*,
    nor the precision (each candidate's command names its own, `precision_for`)."""
    return [o for o in overrides if _section(o) not in PLANNER_KEYS and _key(o) != PRECISION_KEY]


# --------------------------------------------------------------------------- the precision


@dataclass(frozen=True)
class PlanPrecision:
    """The precision a plan prices (compute at its dtype's rate, what crosses at its bytes), and
    why, where the planner chose it rather than the user."""

    name: str
    note: str | None = None


def plan_precision(cfg, overrides: list[str], spec: dict | None) -> PlanPrecision:
    """`precision=` as given; else, for a causal LM on a GPU profile with bf16 tensor cores,
    cmp_bf16 (what decoders are fine-tuned in); else the config's (fp32)."""
    given = [o.split("=", 1)[1] for o in overrides if _key(o) == PRECISION_KEY]
    if given:
        return PlanPrecision(given[-1])
    if spec is not None and choose(cfg).objective.predicts_next_token and spec["peak_tflops"].get("bf16"):
        return PlanPrecision(DECODER_ON_A_GPU, f"precision={DECODER_ON_A_GPU}, the default for a decoder on a GPU "
                                               f"profile (give precision=fp32 or another to plan in it)")
    return PlanPrecision(str(cfg.precision.name))


def precision_for(cls, precision: str) -> str:
    """The plan's precision as strategy `cls` runs it: cross mixed precision (cmp_*) needs an eager
    param server, so a strategy without one computes in the same half dtype under autocast (amp_*)."""
    if precision.startswith("cmp") and not cls.capabilities.cross_precision:
        return "amp_" + precision.split("_", 1)[1]
    return precision


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    request: Request
    profile: Profile
    candidates: list[Candidate]
    kept_overrides: list[str]  # the user's overrides a planned command keeps
    ignored_overrides: list[str]
    precision: PlanPrecision = PlanPrecision("fp32")
    batch_note: str = ""  # where the planner chose a smaller batch than the default one, why
    positions_note: str = ""  # where the planned command raises the model's positions to the length, why
    unplaced: dict = field(default_factory=dict)  # by strategy key: why a placement was offered at no size

    @property
    def best(self) -> Candidate | None:
        fitting = [c for c in self.candidates if c.fits]
        return min(fitting, key=lambda c: c.cost.step_s) if fitting else None

    @property
    def checkpoint_needed(self) -> bool:
        """Whether the printed command names model.pretrained=CHECKPOINT (`shape_as_checkpoint`)."""
        return f"model.pretrained={CHECKPOINT}" in self.kept_overrides

    def command(self, candidate: Candidate) -> str:
        return shlex.join(["relaytrain", "train", *self.kept_overrides, f"{PRECISION_KEY}={candidate.precision}",
                           *candidate.shape.overrides()])

    def to_json(self) -> dict:
        best = self.best
        return {
            "request": self.request.to_json(),
            "precision": {"name": self.precision.name, "note": self.precision.note},
            "best": None if best is None else {
                "command": self.command(best),
                "strategy": best.shape.strategy, "shape": best.shape.describe(), "precision": best.precision,
                "predicted": {"step_time_s": best.cost.step_s, "samples_per_s": best.samples_per_s,
                              "tokens_per_s": best.tokens_per_s, "device_memory_gb": best.memory_bytes / GiB},
                "reference_pass": None if best.reference is None else reference_json(best.reference),
            },
            "candidates": [c.to_json() for c in self.candidates],
            "profile": self.profile.to_json(),
            "ignored_overrides": self.ignored_overrides,
            "batch_note": self.batch_note,
            "positions_note": self.positions_note,
            "note": "times are predictions of the cost model over the profile; memory is a meta-device dry run",
        }


def make_plan(overrides: list[str], max_simulations: int = MAX_SIMULATIONS) -> Plan:
    """Plan for these `relaytrain plan` overrides: profile, candidates, times, dry-run memory.
    A batch the user did not choose (the default 8 x 4) that nothing fits is halved until a
    batch fits (a step of 32 sequences of 32 k tokens is a million tokens: its stash alone may
    outgrow the host); the plan says so. A batch the user gave is planned as given."""
    overrides, positions_note = positions_for_the_length(overrides)
    with shape_as_checkpoint(overrides) as (planned, printed):
        plan = _plan_a_batch(planned, printed, overrides, max_simulations)
    plan.positions_note = positions_note
    return plan


def positions_for_the_length(overrides: list[str]) -> tuple[list[str], str]:
    """(the overrides to plan, why they changed). A model of rotary positions asked for a longer
    sequence than it has positions (`relaytrain plan model=llama3_8b data.seq_len=32768`) is
    planned with model.max_seq_len raised to that length, as a user training past the length
    the model was trained on would set it (a run refuses it otherwise), and the plan says so. A
    learned position table, a checkpoint (its config decides its positions) and a limit the
    user gave are left to the run's own one-line refusal."""
    cfg = resolve(compose(overrides), explicit_overrides(overrides))
    m, seq_len = cfg.model, cfg.data.seq_len
    given = any(_key(o) == "model.max_seq_len" for o in overrides)  # the user's own limit stays theirs
    if seq_len <= m.max_seq_len or given or m.pretrained or not choose(cfg).family.rotary_positions:
        return overrides, ""  # a checkpoint's positions are its config's: the run's refusal says so
    note = (f"model.max_seq_len raised from {m.max_seq_len} to data.seq_len={seq_len} (rotary positions extend "
            f"past the length the model was trained on; long-context fine-tunes usually set model.rope_scaling too)")
    return [*overrides, f"model.max_seq_len={seq_len}"], note


def _plan_a_batch(planned: list[str], printed: list[str], overrides: list[str], max_simulations: int) -> Plan:
    """The plan of the batch asked, or of the largest default batch that fits (`make_plan`)."""
    plan = _make_plan(planned, passthrough(printed), max_simulations)
    if plan.best is not None or any(_key(o) in BATCH_KEYS for o in overrides):
        return plan
    asked, batch = plan.request.batch, plan.request.batch // 2
    while batch >= 1:
        smaller = _make_plan([*planned, f"plan.batch_size={batch}"], passthrough(printed), max_simulations)
        if smaller.best is not None:
            smaller.batch_note = (f"the default batch of {asked} does not fit; {batch} is the largest power of "
                                  f"two below it that does (give plan.batch_size to plan another)")
            return smaller
        batch //= 2
    plan.batch_note = f"no batch from {asked} down to 1 fits either"
    return plan


@contextmanager
def shape_as_checkpoint(overrides: list[str]):
    """(the overrides to plan with, those the planned command keeps). A frozen base of a named
    shape (`model=llama3_70b adapter=lora`, or `model.quantize=nf4`, no model.pretrained) is
    planned over a checkpoint of that shape as published (its config.json, bf16; planning reads no
    weights): an adapter is worth training over a checkpoint only, and model.quantize quantizes
    one. The command names `model.pretrained=CHECKPOINT` for the user's copy of it."""
    cfg = compose(overrides)
    m = cfg.model
    if m.pretrained or not trains_over_a_frozen_base(cfg):
        yield overrides, overrides
        return
    with tempfile.TemporaryDirectory() as directory:
        config = hf_config(m)
        config.dtype = _stored_dtype(m.checkpoint_dtype)
        config.save_pretrained(directory)
        yield [*overrides, f"model.pretrained={directory}"], [*overrides, f"model.pretrained={CHECKPOINT}"]


def _stored_dtype(given: str | None) -> torch.dtype:
    """The dtype model.checkpoint_dtype names, else bf16: as the named shapes' checkpoints store them."""
    dtype = getattr(torch, given or "bfloat16", None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"model.checkpoint_dtype={given} is not a dtype; give bfloat16, float16 or float32")
    return dtype


def trains_over_a_frozen_base(cfg) -> bool:
    """An adapter trains (LoRA, QLoRA), or the base is quantized: either way the base is frozen."""
    return adapter.enabled(cfg.adapter) or str(cfg.model.quantize) != "none"


def _make_plan(overrides: list[str], kept_in_command: list[str], max_simulations: int) -> Plan:
    cfg = resolve(compose(overrides), explicit_overrides(overrides))
    # What every candidate would need from this environment, said once rather than as each one's refusal.
    check_available(state_bits(cfg.optim))
    spec = None if str(cfg.plan.device) == "this" else load_spec(str(cfg.plan.device))
    precision = plan_precision(cfg, overrides, spec)
    if precision.name != str(cfg.precision.name):  # the profile times the plan's precision
        cfg = resolve(compose([*overrides, f"{PRECISION_KEY}={precision.name}"]), explicit_overrides(overrides))
    device = None if spec else _this_device(cfg)  # decided once: profiled, and every candidate checked on it
    request = read_request(cfg, overrides, int(spec["memory_gb"] * GiB) if spec else _device_memory(device))
    kept = passthrough(overrides)
    offered = offer(request, cfg)
    shapes = offered.shapes
    bases = {name: resolve(compose([*kept, f"strategy={name}",
                                    f"{PRECISION_KEY}={precision_for(strategy_class(name), precision.name)}"]),
                           explicit_overrides(kept))
             for name in dict.fromkeys(shape.strategy for shape in shapes)}
    if not shapes:
        raise ConfigError(f"no shape of {', '.join(request.strategies)} trains a batch of {request.batch} on "
                          f"{request.workers} worker(s); a pipeline needs plan.workers >= 2 (and some schedules a batch "
                          f"of at least their depth): raise plan.workers or plan.batch_size")
    sizes = sorted({sequences(s.microbatch_size, request.rows_per_item) for s in shapes})  # a profile times sequences
    online = choose(cfg).objective.learns_online  # sampling: a decoded token timed or priced too
    profile = from_spec(spec, cfg, sizes, online) if spec else measure_as_run(cfg, sizes, sorted({s.workers for s in shapes}),
                                                                                device)
    facts = _facts_by_precision(bases)
    candidates = [check_candidate(shape, base, facts[str(base.precision.name)], profile, request, device)
                  for shape in shapes for base in [bases[shape.strategy]]]
    candidates.sort(key=lambda c: (c.cost is None, c.cost.step_s if c.cost else 0.0))
    ignored = [o for o in overrides if _section(o) in IGNORED_KEYS and _key(o) != RUN_DIR_KEY]
    plan = Plan(request, profile, candidates, kept_in_command, ignored, precision, unplaced=offered.unplaced)
    decide_memory(candidates, bases, request, profile, max_simulations)
    return plan


def measure_as_run(cfg, sizes: list[int], workers: list[int], device) -> Profile:
    """This machine's profile, timed as a run's workers compute: with glibc keeping freed memory
    (`launch.keep_freed_host_memory`, which every worker sets before its first step), so the
    profile's repetitions reuse their buffers as a run's micro-batches do instead of handing
    them back and faulting them in again."""
    keep_freed_host_memory()  # for this process, as for a worker: the planner's is about to end or to run
    return measure(cfg, sizes, workers, device, time_decode if choose(cfg).objective.learns_online else None)


def _facts_by_precision(bases: dict) -> dict[str, ModelFacts]:
    """The model's facts under each precision the strategies run the plan's in (weights' and
    activations' bytes differ between cmp_* and amp_*)."""
    first = {str(base.precision.name): base for base in bases.values()}
    return {name: ModelFacts.of(base) for name, base in first.items()}


def _this_device(cfg):
    device = pick_device(cfg.train.device)
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"plan.device=this profiles a CPU or CUDA device, not train.device={cfg.train.device}")
    return device


def _device_memory(device) -> int | None:
    import torch

    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


# --------------------------------------------------------------------------- one config


@dataclass(frozen=True)
class Prediction:
    """The cost model's step time for one config on this machine (a prediction), and the dry
    run's device memory as the CUDA allocator will report its peak (the tensors and cuBLAS's
    workspaces) where there is a separate device (None on a CPU)."""

    step_time_s: float
    samples_per_s: float
    device_memory_bytes: int | None


def predict(cfg) -> Prediction:
    """Predict `cfg`'s step on this machine with its strategy's cost model, profiling one block
    briefly at the config's micro-batch size (and gloo, when it has several workers). Device
    memory: the meta-device dry run on a CUDA device; None on a CPU (no separate device)."""
    cls, s = choose(cfg).strategy, cfg.strategy
    device = _this_device(cfg)
    # Every power of two up to b: the profile stops timing where a block's forward and backward
    # would pass PART_BUDGET_S and extrapolates from there, so a large model costs seconds, not minutes.
    # The profile times sequences: a micro-batch of b preference pairs is 2b of them.
    facts = ModelFacts.of(cfg)
    sizes = sorted({facts.rows(b) for b in {*powers_of_two_dividing(s.microbatch_size), s.microbatch_size}})
    profile = measure_as_run(cfg, sizes, [cls.processes(cfg)], device)
    memory = simulate(cfg).allocator_peak_bytes if device.type == "cuda" else None
    free = free_between_steps(_device_memory(device), facts)  # where a host-held policy's copy must fit
    cost = with_sampling(cls.cost_model.step_cost(cfg, facts, profile),
                         sampling_for(cfg, cls, facts, profile, cls.processes(cfg), free), cfg)
    batch = s.microbatch_size * s.num_microbatches * cls.replicas(cfg)
    return Prediction(cost.step_s, batch / cost.step_s, memory)
