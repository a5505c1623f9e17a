"""Machine profiles for the planner: how long one transformer block of the configured model
takes forward and backward, what the embeddings, the head and an optimizer step cost, and
how fast bytes move between host, devices and workers.

Two kinds, never mixed, and a profile's `source` says which:

- **measured** (`measure`): this machine, timed. One block of the real layered model
  (`build_model` with one block) runs forward and backward at a few micro-batch sizes: one
  warm-up, then the median of a few timed repetitions, with the threads each worker of a run
  would get. Sizes whose one repetition would exceed the time budget are extrapolated
  linearly from the largest measured one (and listed as such). On a CPU the device *is* the
  host: nothing crosses between them, and worker processes share the cores.
- **spec** (`from_spec`): a GPU you do not have, from a JSON file of spec-sheet figures
  (configs/profiles/NAME.json). Times are the block's and the head's FLOPs (`cost.work`, the
  count the layouts and a run's model FLOP/s use too) over the peak rate times a stated
  efficiency, bandwidths the links' peaks times a stated efficiency. Nothing from it is a
  measurement, and its `source` must say so.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch

from relaytrain.cost.rates import REPEATS, links_of_this_machine, memory_rate, pinned_copy_rate
from relaytrain.cost.work import model_work
from relaytrain.models import build_model, part_parameters
from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.objectives import objective
from relaytrain.placement.world import threads_per_process, usable_cores
from relaytrain.records.checkpoint import unique_named_parameters
from relaytrain.step import metrics
from relaytrain.step.lowbit import host_time_vs_fp32, state_bits
from relaytrain.step.muon import orthogonalize_beside
from relaytrain.step.optim import build_optimizer, state_words
from relaytrain.step.precision import Precision
from relaytrain.step.rounding import ROUNDING_VS_FP32_ADAMW, Bf16Masters, bf16_masters
from relaytrain.utils.errors import ConfigError

PART_BUDGET_S = 0.4  # a block's forward + backward slower than this: larger sizes are extrapolated
SPEC_REQUIRED = ("name", "device", "source", "memory_gb", "peak_tflops", "compute_efficiency",
                 "tokens_half_efficiency", "memory_bandwidth_gb_s", "host_to_device_gb_s", "stage_link_gb_s",
                 "allreduce_gb_s", "inter_node_gb_s", "devices_per_node", "link_efficiency",
                 "link_latency_s", "host_optimizer_gb_s", "kernel_overhead_s_per_block")


@dataclass(frozen=True)
class PartTimes:
    """Seconds for one part (a block, the embeddings or the head) on one micro-batch."""

    forward_s: float
    backward_s: float  # input and weight gradients

    def scaled(self, factor: float) -> PartTimes:
        return PartTimes(self.forward_s * factor, self.backward_s * factor)


@dataclass
class Timings:
    """One worker's figures, by micro-batch size: block, embeddings, head, and optimizer steps.

    `optimizer_*_s` are one optimizer step over one block's parameters and over the
    embeddings' and head's (the EPS steps per part; a whole-model step is their sum).
    """

    block: dict[int, PartTimes]
    embed: dict[int, PartTimes]
    head: dict[int, PartTimes]
    optimizer_block_s: float
    optimizer_ends_s: float
    extrapolated: list[int] = field(default_factory=list)  # sizes predicted from a smaller one, not timed
    # A decoded token by the sequences decoding together (an online objective's sampling; empty
    # otherwise): one position of each through a block, and the rest of the step.
    decode: dict[int, DecodeTimes] = field(default_factory=dict)

    def part(self, name: str, b: int) -> PartTimes:
        """A part's times at micro-batch size `b`: as measured, or linear in b from the nearest
        measured size below (time per sample is flat once a micro-batch fills the machine)."""
        return _at_size(getattr(self, name), b)

    def decode_at(self, sequences: int) -> DecodeTimes | None:
        """A decoded token's times with `sequences` decoding together (as `part` reads sizes not
        timed); None where the profile timed no decoding."""
        return _at_size(self.decode, sequences) if self.decode else None

    def scaled(self, factor: float) -> Timings:
        """Every time `factor` times longer (workers time-sharing the cores)."""
        tables = (self.block, self.embed, self.head, self.decode)
        block, embed, head, decode = ({b: t.scaled(factor) for b, t in table.items()} for table in tables)
        return Timings(block, embed, head, self.optimizer_block_s * factor, self.optimizer_ends_s * factor,
                       list(self.extrapolated), decode)


@dataclass(frozen=True)
class DecodeTimes:
    """Seconds of one decoded token of some sequences decoding together, each reading its cache:
    one block's call on one position of each (its work, its weights read, its kernel launches and
    Python, which a forward over data.seq_len tokens pays once and a decoded token pays every
    time), and the rest of the step (embeddings, final norm and head, the draw)."""

    block_s: float
    rest_s: float
    reads_cache: bool = False  # timed with a cache of half data.seq_len: its reading is in block_s

    def scaled(self, factor: float) -> DecodeTimes:
        return DecodeTimes(self.block_s * factor, self.rest_s * factor, self.reads_cache)


# Times a decoded token of b sequences on the one-block model: (model, cfg, b, precision, device).
DecodeTimer = Callable[[LayeredModel, object, int, Precision, torch.device], DecodeTimes]


def _at_size(table: dict, b: int):
    """A table's entry at size `b`: as timed, or linear in b from the nearest timed size below
    (time per sample is flat once a micro-batch fills the machine)."""
    if b in table:
        return table[b]
    below = max((k for k in table if k < b), default=min(table))
    return table[below].scaled(b / below)


@dataclass
class Profile:
    """A machine, as the cost models see it.

    Bandwidths in bytes/s; `host_to_device_bytes_per_s` is None where the device is the host
    (a CPU: no transfer at all). `timings` holds one `Timings` per torch-thread count a
    worker gets (CPU: workers share the cores) or one under key 0 (a GPU: one per worker).
    """

    name: str
    device: str
    device_type: str  # cpu or cuda
    source: str
    cores: int
    memory_bytes: int | None  # each device's memory, where the profile knows it
    host_to_device_bytes_per_s: float | None
    stage_link_bytes_per_s: float  # point to point between pipeline stages
    allreduce_bytes_per_s: float  # an all-reduce's bus bandwidth among replicas in one node
    inter_node_bytes_per_s: float  # between nodes: links of replicas or stages spread over nodes
    devices_per_node: int
    link_latency_s: float  # per message
    host_optimizer_s_per_param: float  # the EPS's optimizer step on the host, per parameter
    timings: dict[int, Timings]
    # Bytes/s a device streams from its own memory (decoding reads every weight once a token):
    # a spec's bandwidth times its efficiency, or a copy timed here (a CPU: the host's memory).
    memory_bytes_per_s: float | None = None

    def for_workers(self, workers: int, configured_threads: int = 0) -> Timings:
        """The timings of one of `workers` processes running at once on this machine.

        GPU: each worker has its own device. CPU: each gets `train.threads` threads, or
        cores // workers (as the launcher shares them out, `world.threads_per_process`); more
        threads than cores time-share, so every figure takes threads / cores times longer.
        """
        if self.device_type != "cpu":
            return self.timings[0]
        threads = threads_per_process(configured_threads, workers, self.cores)
        if threads not in self.timings:
            raise ValueError(f"this profile was not measured with {threads} threads per worker")
        return self.timings[threads].scaled(max(1.0, workers * threads / self.cores))

    def to_json(self) -> dict:
        out = asdict(self)
        out["timings"] = {str(k): _timings_json(t) for k, t in self.timings.items()}
        return out


def _timings_json(t: Timings) -> dict:
    names = ("block", "embed", "head", "decode")
    tables = {name: {str(b): asdict(p) for b, p in getattr(t, name).items()} for name in names}
    return {**tables, "optimizer_block_s": t.optimizer_block_s, "optimizer_ends_s": t.optimizer_ends_s,
            "extrapolated": t.extrapolated}


# --------------------------------------------------------------------------- this machine


def measure(cfg, microbatch_sizes: list[int], worker_counts: list[int], device: torch.device,
            time_decode: DecodeTimer | None = None) -> Profile:
    """Time this machine's `device` (the CPU, or a CUDA device) on `cfg`'s model at these
    micro-batch sizes, for runs of each of these numbers of workers; with `time_decode`, a
    decoded token at each size too (an online objective's sampling: `planner.sampling`, which
    holds the rollout engine this layer does not see)."""
    cores = usable_cores()
    configured = cfg.train.threads
    keys = sorted({threads_per_process(configured, w, cores) for w in worker_counts}) if device.type == "cpu" else [0]
    saved = torch.get_num_threads()
    try:
        timings = {}
        for threads in keys:
            torch.set_num_threads(threads or saved)
            timings[threads] = measure_timings(cfg, sorted(set(microbatch_sizes)), device, time_decode)
    finally:
        torch.set_num_threads(saved)
    p2p, allreduce, latency, how = links_of_this_machine(device, max(worker_counts))
    return Profile(
        name="this", device=_describe_this(device, cores), device_type=device.type,
        source=f"measured on this machine ({time.strftime('%Y-%m-%d %H:%M')}): one block of the configured model, "
               f"median of {REPEATS} timed repetitions after a warm-up; links: {how}",
        cores=cores, memory_bytes=torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        host_to_device_bytes_per_s=pinned_copy_rate(device) if device.type == "cuda" else None,
        stage_link_bytes_per_s=p2p, allreduce_bytes_per_s=allreduce, inter_node_bytes_per_s=allreduce,
        devices_per_node=torch.cuda.device_count() if device.type == "cuda" else cores, link_latency_s=latency,
        host_optimizer_s_per_param=_host_optimizer_s_per_param(cfg, timings, device), timings=timings,
        memory_bytes_per_s=memory_rate(device),
    )


def measure_timings(cfg, sizes: list[int], device: torch.device, time_decode: DecodeTimer | None = None) -> Timings:
    """Block, embeddings, head and optimizer of `cfg`'s model, timed at each size in `sizes`; a
    decoded token too, with `time_decode`."""
    model = one_block_model(cfg, device)
    precision = Precision.from_name(str(cfg.precision.name))
    tables: dict[str, dict[int, PartTimes]] = {"block": {}, "embed": {}, "head": {}}
    extrapolated, decode = [], {}
    for b in sizes:
        if tables["block"] and _too_slow(tables["block"], b):
            extrapolated.append(b)
            continue
        for name, times in _time_parts(model, cfg, b, precision, device).items():
            tables[name][b] = times
        if time_decode is not None:
            decode[b] = time_decode(model, cfg, b, precision, device)
    optimizer_block, optimizer_ends = _time_optimizers(model, cfg)
    return Timings(tables["block"], tables["embed"], tables["head"], optimizer_block, optimizer_ends, extrapolated,
                   decode)


def one_block_model(cfg, device: torch.device) -> LayeredModel:
    """The configured model with one block, fresh weights (their values do not change the time)."""
    m = copy.deepcopy(cfg.model)
    m.num_layers, m.pretrained, m.resolved_from = 1, None, None
    model = build_model(m, seed=0, quiet=True).to(device)
    weight_dtype = Precision.from_name(str(cfg.precision.name)).weight_dtype
    return model.to(weight_dtype) if weight_dtype != torch.float32 else model


def _too_slow(measured: dict[int, PartTimes], b: int) -> bool:
    largest = max(measured)
    t = measured[largest]
    return (t.forward_s + t.backward_s) * b / largest > PART_BUDGET_S


def sample_microbatch(cfg, b: int, device: torch.device) -> MicroBatch:
    """A micro-batch of `b` random samples shaped as the config's data (labels as the task needs)."""
    m, s = cfg.model, cfg.data.seq_len
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, m.vocab_size, (b, s), generator=generator)
    labels = torch.randint(0, m.num_labels, (b,), generator=generator) if objective(m.task).classifies else ids.clone()
    return MicroBatch(ids, labels).to(device)


def _time_parts(model: LayeredModel, cfg, b: int, precision: Precision, device: torch.device) -> dict[str, PartTimes]:
    mb = sample_microbatch(cfg, b, device)
    with torch.no_grad(), precision.autocast_context(device):
        hidden = model.embed(mb.input_ids)
    ctx = model.context(mb, hidden)
    block = model.blocks[0]

    def embed():
        return model.embed(mb.input_ids)

    def run_block():
        return block(hidden.detach().requires_grad_(True), ctx)

    def head():
        return model.head_loss(hidden.detach().requires_grad_(True), mb).total

    return {name: _forward_backward(fn, precision, device) for name, fn in
            (("embed", embed), ("block", run_block), ("head", head))}


def _forward_backward(forward, precision: Precision, device: torch.device) -> PartTimes:
    """Median forward and backward seconds of `forward()` (a tensor; backward from ones)."""
    forwards, backwards = [], []
    for repetition in range(REPEATS + 1):
        metrics.synchronize(device)
        start = time.perf_counter()
        with precision.autocast_context(device):
            out = forward()
        metrics.synchronize(device)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        metrics.synchronize(device)
        if repetition:  # the first is the warm-up
            forwards.append(middle - start)
            backwards.append(time.perf_counter() - middle)
    return PartTimes(statistics.median(forwards), statistics.median(backwards))


def median_s(fn, device: torch.device, repeats: int = REPEATS) -> float:
    """Median seconds of `fn()` over `repeats` calls after a warm-up."""
    times = []
    for repetition in range(repeats + 1):
        metrics.synchronize(device)
        start = time.perf_counter()
        fn()
        metrics.synchronize(device)
        if repetition:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_optimizers(model: LayeredModel, cfg) -> tuple[float, float]:
    """One optimizer step over one block's parameters, and over the embeddings' and head's."""
    block = block_named_parameters(model)
    in_block = {id(p) for _, p in block}
    ends = [(n, p) for n, p in unique_named_parameters(model) if id(p) not in in_block]
    return _time_optimizer(block, cfg), _time_optimizer(ends, cfg)


def block_named_parameters(model: LayeredModel) -> list:
    """The first block's parameters named as in the whole model (`blocks.0.…`): an optimizer that
    treats a block's matrices apart (Muon) steps them as it would in a run."""
    return [(f"blocks.0.{name}", p) for name, p in model.blocks[0].named_parameters()]


def _time_optimizer(named: list, cfg, beside: torch.device | None = None) -> float:
    """Median seconds of one step of the configured optimizer over fp32 copies of `named`; with
    bf16 masters (`optim.master_dtype`), over bf16 copies stepped as the eager param server does;
    host masters `beside` a GPU: Muon's Newton-Schulz steps where the server would run them."""
    rounding = Bf16Masters(0, lambda p: "timed", cfg.optim.host_loops) if bf16_masters(cfg.optim) else None
    masters = [(n, torch.nn.Parameter(p.detach().float().clone()) if rounding is None  # fp32, on p's device
                else rounding.stand_in(torch.nn.Parameter(p.detach().bfloat16()))) for n, p in named]
    for _, p in masters:
        p.grad = torch.randn(p.shape, device=p.device) * 1e-3
    optimizer = build_optimizer(masters, cfg.optim)
    if beside is not None:
        orthogonalize_beside([optimizer], beside, cfg.optim)
    updating = contextlib.nullcontext if rounding is None else lambda: rounding.updating(optimizer, [p for _, p in masters])

    def step():
        with updating():
            optimizer.step()
    return median_s(step, masters[0][1].device)


def _host_optimizer_s_per_param(cfg, timings: dict[int, Timings], device: torch.device) -> float:
    """The EPS's optimizer on this host, per parameter: on a CPU the step timed with the most
    threads (the cost models use each worker's own timings there); with a CUDA device, a host
    step over a block's fp32 parameters."""
    block_params = _block_parameters(cfg)
    if device.type == "cpu":
        return timings[max(timings)].optimizer_block_s / block_params
    model = one_block_model(cfg, torch.device("cpu"))
    return _time_optimizer(block_named_parameters(model), cfg, beside=device) / block_params


def _block_parameters(cfg) -> int:
    return part_parameters(cfg.model)[1]


def _describe_this(device: torch.device, cores: int) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x {torch.cuda.device_count()} (this machine)"
    return f"CPU, {cores} cores (this machine), torch {torch.__version__}"


# --------------------------------------------------------------------------- spec sheets


PROFILES = "profiles"  # configs/profiles/NAME.json, shipped in the package relaytrain.configs


def spec_names() -> list[str]:
    folder = resources.files("relaytrain.configs") / PROFILES
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_spec(name_or_path: str) -> dict:
    """A GPU profile file: a name in configs/profiles/ or a path to a JSON file, checked."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        packaged = resources.files("relaytrain.configs") / PROFILES / f"{name_or_path}.json"
        if not packaged.is_file():
            raise ConfigError(f"plan.device={name_or_path} is neither `this`, a profile ({', '.join(spec_names())}) "
                              f"nor a JSON file; give one of them")
        path = Path(str(packaged))
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"plan.device={name_or_path}: {path} is not a readable JSON profile ({err})") from err
    missing = [key for key in SPEC_REQUIRED if key not in spec]
    if missing:
        raise ConfigError(f"plan.device={name_or_path}: the profile lacks {', '.join(missing)}")
    if not str(spec["source"]).startswith(("spec sheet, not measured", "measured")):
        raise ConfigError(f"plan.device={name_or_path}: its source must begin with 'spec sheet, not measured' "
                          f"or 'measured' (where the figures come from)")
    return spec


def from_spec(spec: dict, cfg, microbatch_sizes: list[int], decode: bool = False) -> Profile:
    """The spec's predicted timings for `cfg`'s model: FLOPs over peak x efficiency; with
    `decode`, a decoded token's too (an online objective's sampling)."""
    rate = _sustained_flops(spec, cfg)
    link = spec["link_efficiency"] * 1e9
    work = model_work(cfg.model, cfg.data.seq_len)  # a sample's forward FLOPs through a block and the head
    timings = Timings(
        block={b: _spec_part(b * work.block, rate, spec, cfg, b, overhead=True) for b in microbatch_sizes},
        embed={b: _spec_part(embed_bytes(cfg, b), spec["memory_bandwidth_gb_s"] * link, spec, cfg, b)
               for b in microbatch_sizes},
        head={b: _spec_part(b * work.head, rate, spec, cfg, b) for b in microbatch_sizes},
        optimizer_block_s=_block_parameters(cfg) * optimizer_bytes_per_param(cfg) / (spec["memory_bandwidth_gb_s"] * link),
        optimizer_ends_s=_ends_parameters(cfg) * optimizer_bytes_per_param(cfg) / (spec["memory_bandwidth_gb_s"] * link),
        decode={b: _spec_decode(b, model_work(cfg.model, 1), rate, spec) for b in microbatch_sizes} if decode else {},
    )
    return Profile(
        name=spec["name"], device=spec["device"], device_type="cuda", source=spec["source"],
        cores=spec["devices_per_node"], memory_bytes=int(spec["memory_gb"] * 2**30),
        host_to_device_bytes_per_s=spec["host_to_device_gb_s"] * link,
        stage_link_bytes_per_s=spec["stage_link_gb_s"] * link, allreduce_bytes_per_s=spec["allreduce_gb_s"] * link,
        inter_node_bytes_per_s=spec["inter_node_gb_s"] * link, devices_per_node=spec["devices_per_node"],
        link_latency_s=spec["link_latency_s"],
        host_optimizer_s_per_param=_spec_host_optimizer_s_per_param(cfg, spec["host_optimizer_gb_s"] * link),
        timings={0: timings}, memory_bytes_per_s=spec["memory_bandwidth_gb_s"] * link,
    )


def _sustained_flops(spec: dict, cfg) -> float:
    """Peak FLOP/s of the precision's matmuls times the compute efficiency the profile assumes."""
    precision = str(cfg.precision.name)
    kind = "fp32" if precision == "fp32" else precision.split("_")[1]
    # FP8 products are priced at bf16's rate: a bound, since attention, the head and every other
    # operation stay in bf16 and the FP8 gain on the blocks' projections is not measured here yet.
    kind = "bf16" if kind == "fp8" else kind
    peak = spec["peak_tflops"].get(kind)
    if not peak:
        raise ConfigError(f"plan.device={spec['name']} has no peak_tflops for {kind}; choose another precision=")
    return peak * 1e12 * spec["compute_efficiency"][kind if kind in spec["compute_efficiency"] else "fp32"]


def _spec_part(work: float, rate: float, spec: dict, cfg, b: int, overhead: bool = False) -> PartTimes:
    """Forward `work / rate` at full efficiency, lower for small micro-batches (kernels too small to
    fill the device: efficiency n / (n + n_half) in the tokens n of a micro-batch); backward twice."""
    tokens = b * cfg.data.seq_len
    filled = tokens / (tokens + spec["tokens_half_efficiency"])
    forward = work / (rate * filled) + (spec["kernel_overhead_s_per_block"] if overhead else 0.0)
    return PartTimes(forward, 2 * forward)


def _spec_decode(sequences: int, work, rate: float, spec: dict) -> DecodeTimes:
    """A decoded token of `sequences` sequences: the block's and the head's FLOPs for one token of
    each (`work`: one token's) at the sustained rate, plus a block's kernel overhead each block
    and about two blocks' for the embeddings, head and draw (an assumption of the profile's
    kind, as its overhead is). So few tokens do not fill the device, but a decode step's kernels
    are bound by reading their weights, which `cost.rollout` counts apart (the larger of the two)."""
    overhead = spec["kernel_overhead_s_per_block"]
    return DecodeTimes(sequences * work.block / rate + overhead, sequences * work.head / rate + 2 * overhead)


def embed_bytes(cfg, b: int) -> float:
    """The embeddings are a lookup: bytes read and written, not FLOPs (timed at memory bandwidth)."""
    return 3 * b * cfg.data.seq_len * cfg.model.hidden_size * 4


def _spec_host_optimizer_s_per_param(cfg, bytes_per_s: float) -> float:
    """The EPS's host update per parameter on a profile's host: fp32 AdamW's bytes at its rate;
    AdamW with 8- or 4-bit moments measured as so many times fp32's (`lowbit.host_time_vs_fp32`);
    bf16 masters add their copy up and rounding back, measured the same way (`rounding`)."""
    o, fp32_adamw = cfg.optim, _update_bytes(state_words=2) / bytes_per_s
    update = optimizer_bytes_per_param(cfg) / bytes_per_s if state_bits(o) == 32 else fp32_adamw * host_time_vs_fp32(o)
    return update + (fp32_adamw * ROUNDING_VS_FP32_ADAMW[o.host_loops] if bf16_masters(o) else 0.0)


def optimizer_bytes_per_param(cfg) -> float:
    """Bytes an optimizer step reads and writes per fp32 parameter (AdamW/LAMB: 2 moments; SGD:
    momentum or none; fewer words for 8- and 4-bit moments)."""
    return _update_bytes(state_words(cfg.optim))


def _update_bytes(state_words: float) -> float:
    """Weight, gradient and state read, weight and state written, per parameter."""
    return 4 * (2 + state_words) + 4 * (1 + state_words)


def _ends_parameters(cfg) -> int:
    embed, _, head = part_parameters(cfg.model)
    return embed + head
