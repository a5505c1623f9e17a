"""Closed-form cost models: a candidate's predicted step time on a profiled machine, and its
closed-form device memory (to prune hopeless candidates before the dry run, and to report
beside the simulated figure).

Every figure here is a prediction. The models, per strategy:

- **baseline** (L2L paper, Algorithm 1): per micro-batch, the embeddings, every block and the
  head forward and backward (block recompute: one more forward per block); then one
  optimizer step over the whole model.
- **l2l, l2l_stash_cpu** (L2L paper, §2.2.1, equations 1-6): with C the forward of one block
  on one micro-batch and X the transfer of one block, a minibatch of u micro-batches costs
  N (4uC + 2X): forward uC + X, recompute and backward 3uC + X. Here the measured forward
  and backward replace C and 2C, and with `strategy.prefetch` (the default) a transfer
  overlaps the compute of the part before it, so each part costs the larger of the two
  rather than their sum. The stash on the host adds, per block, every micro-batch's input
  down in forward and up in backward. The eager param server updates each part on the host
  while the parts below compute (only what outlasts the backward is exposed) and, with
  replicas, each part's gradients are summed over them in the background the same way.
- **pipe_flush, pipe_2bw, pipe_gpipe** (PipeDream-2BW, §4.2.1): stage i costs
  t_i = max(T_i^comp, T_i^comm) per micro-batch, compute (times the recompute factor) and
  the activations and gradients exchanged with its neighbours overlapping. PipeDream-2BW
  keeps the pipeline full: m x max t_i per minibatch; Flush and GPipe fill and drain it every
  minibatch: sum t_i + (m - 1) max t_i, which for equal stages is (m + d - 1) t, the bubble
  (d - 1) / (m + d - 1). Then the all-reduce of each stage's gradients across the w replicas
  (hidden under the next minibatch by 2BW) and the stage's optimizer step.

On a CPU (the device is the host) nothing crosses a host<->device link, and work done "in
the background" (the EPS's updates, gradient sums over gloo) runs on the same cores as the
compute, so it is added, not hidden.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch

from relaytrain.profile import PartTimes, Profile, Timings
from relaytrain.strategies.base import activation_bytes_per_block, optimizer_words
from relaytrain.strategies.pipeline.stage import partition

PIPELINES = ("pipe_flush", "pipe_2bw", "pipe_gpipe")
RELAYS = ("l2l", "l2l_stash_cpu")
FP32 = 4


@dataclass(frozen=True)
class Shape:
    """How a candidate runs: the strategy and every key of its shape."""

    strategy: str
    microbatch_size: int  # per worker (strategy.microbatch_size)
    num_microbatches: int  # m, or L2L's inner loop u
    replicas: int = 1  # w: data-parallel width
    stages: int = 1  # d: pipeline depth
    recompute: str = "none"  # baseline: none/block; pipelines: none/block/stage; L2L always recomputes

    @property
    def workers(self) -> int:
        return self.replicas * self.stages

    @property
    def batch(self) -> int:
        """Samples per step (the global minibatch)."""
        return self.microbatch_size * self.num_microbatches * self.replicas

    def overrides(self) -> list[str]:
        """The `relaytrain train` overrides that run this shape."""
        out = [f"strategy={self.strategy}", f"strategy.microbatch_size={self.microbatch_size}",
               f"strategy.num_microbatches={self.num_microbatches}"]
        if self.strategy in PIPELINES:
            out += [f"strategy.stages={self.stages}", f"strategy.replicas={self.replicas}",
                    f"strategy.recompute={self.recompute}"]
        elif self.strategy in RELAYS and self.replicas > 1:
            out.append(f"strategy.replicas={self.replicas}")
        elif self.strategy == "baseline" and self.recompute != "none":
            out.append(f"strategy.recompute={self.recompute}")
        return out

    def describe(self) -> str:
        width = f"w={self.replicas} " if self.replicas > 1 or self.strategy in PIPELINES else ""
        depth = f"d={self.stages} " if self.strategy in PIPELINES else ""
        loop = "u" if self.strategy in RELAYS else "m"
        redo = f" rc={self.recompute}" if self.strategy not in RELAYS else ""
        return f"{width}{depth}b={self.microbatch_size} {loop}={self.num_microbatches}{redo}"


@dataclass(frozen=True)
class ModelFacts:
    """What the cost models need of the configured model and run: sizes, bytes per value."""

    num_layers: int
    hidden: int
    seq_len: int
    embed_params: int
    block_params: int
    head_params: int
    weight_bytes: int  # bytes of a weight where it computes (fp32: 4; cross mixed precision: 2)
    activation_bytes: int  # bytes of an activation value (fp32: 4; amp, cmp: 2)
    state_words: int  # fp32 optimizer-state words per parameter
    logits_per_sample: int  # values the head's logits hold per sample (an LM: seq x vocabulary)
    cfg: object = field(repr=False, compare=False)

    @classmethod
    def of(cls, cfg) -> ModelFacts:
        embed, block, head = part_parameters(cfg)
        precision = str(cfg.precision.name)
        m = cfg.model
        return cls(m.num_layers, m.hidden_size, cfg.data.seq_len, embed, block, head,
                   2 if precision.startswith("cmp") else FP32, FP32 if precision == "fp32" else 2,
                   optimizer_words(cfg), 0 if str(m.task) == "classification" else cfg.data.seq_len * m.vocab_size, cfg)

    @property
    def params(self) -> int:
        return self.embed_params + self.num_layers * self.block_params + self.head_params

    def boundary_bytes(self, b: int) -> int:
        """A block's input (or output) for b samples: what a stash entry holds and a stage sends."""
        return b * self.seq_len * self.hidden * self.activation_bytes

    def block_activation_bytes(self, b: int) -> int:
        """What one block keeps for its backward, for b samples (Korthikanti et al., 2022)."""
        shaped = copy.deepcopy(self.cfg)
        shaped.strategy.microbatch_size = b
        return activation_bytes_per_block(shaped, self.activation_bytes)

    def head_activation_bytes(self, b: int) -> int:
        return b * self.logits_per_sample * FP32 * 3  # logits, their softmax and gradient in fp32


def part_parameters(cfg) -> tuple[int, int, int]:
    """Parameters of the embeddings, of one block and of the head (a tied weight counted once,
    with the embeddings), from a one-block model on the meta device."""
    from relaytrain.models import build_model

    m = copy.deepcopy(cfg.model)
    m.num_layers, m.pretrained, m.resolved_from = 1, None, None
    with torch.device("meta"):
        model = build_model(m, quiet=True)
    seen: set[int] = set()

    def count(module) -> int:
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return sum(p.numel() for p in fresh)

    return count(model.embed), count(model.blocks[0]), count(model.head)


@dataclass
class StepCost:
    """A predicted step, in seconds, with where the time goes (the parts may overlap: the
    step is what the model says, the parts explain it)."""

    step_s: float
    parts: dict[str, float]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def step_cost(shape: Shape, facts: ModelFacts, profile: Profile, options, threads: int = 0) -> StepCost:
    """The predicted step time of `shape` on `profile`'s machine. `options`: the run's `strategy`
    config (L2L's prefetch and EPS placement); `threads`: train.threads (0: the cores shared out)."""
    timings = profile.for_workers(shape.workers, threads)
    if shape.strategy in PIPELINES:
        return pipeline_cost(shape, facts, profile, timings)
    if shape.strategy in RELAYS:
        return l2l_cost(shape, facts, profile, timings, options)
    return baseline_cost(shape, facts, timings)


# --------------------------------------------------------------------------- baseline


def baseline_cost(shape: Shape, facts: ModelFacts, t: Timings) -> StepCost:
    b, m = shape.microbatch_size, shape.num_microbatches
    block, embed, head = t.part("block", b), t.part("embed", b), t.part("head", b)
    recompute = block.forward_s if shape.recompute == "block" else 0.0
    per_microbatch = _both(embed) + facts.num_layers * (_both(block) + recompute) + _both(head)
    optimizer = facts.num_layers * t.optimizer_block_s + t.optimizer_ends_s
    compute = m * per_microbatch
    return StepCost(compute + optimizer, {"compute": compute, "optimizer": optimizer})


def _both(p: PartTimes) -> float:
    return p.forward_s + p.backward_s


# --------------------------------------------------------------------------- L2L


def l2l_cost(shape: Shape, facts: ModelFacts, profile: Profile, t: Timings, options) -> StepCost:
    """L2L's relay (equations 1-6, with measured forward/backward and prefetch overlap)."""
    b, u = shape.microbatch_size, shape.num_microbatches
    block, embed, head = t.part("block", b), t.part("embed", b), t.part("head", b)
    overlap = bool(options.prefetch)
    x_block = _upload_s(facts.block_params * facts.weight_bytes, profile)
    x_embed = _upload_s(facts.embed_params * facts.weight_bytes, profile)
    x_head = _upload_s(facts.head_params * facts.weight_bytes, profile)
    stash = u * _upload_s(facts.boundary_bytes(b), profile) if shape.strategy == "l2l_stash_cpu" else 0.0
    n = facts.num_layers
    forward = (_relay(u * embed.forward_s, x_embed, overlap)
               + n * _relay(u * block.forward_s, max(x_block, stash), overlap))
    turnaround = _relay(u * _both(head), x_head, overlap)
    backward = (n * _relay(u * (block.forward_s + block.backward_s), x_block + stash, overlap)
                + _relay(u * _both(embed), x_embed, overlap))
    compute = u * (_both(embed) + embed.forward_s + n * (2 * block.forward_s + block.backward_s) + _both(head))
    transfers = 2 * (n * x_block + x_embed) + x_head + 2 * n * stash
    optimizer, sums = _eps_exposed(shape, facts, profile, t, backward, str(options.eps) == "sharded")
    parts = {"compute": compute, "transfers": transfers, "optimizer (exposed)": optimizer}
    if shape.replicas > 1:
        parts["gradient sums (exposed)"] = sums
    step = forward + turnaround + backward + optimizer + sums
    notes = [] if profile.host_to_device_bytes_per_s else ["the device is the host: nothing crosses a link"]
    return StepCost(step, parts, notes)


def _upload_s(nbytes: float, profile: Profile) -> float:
    rate = profile.host_to_device_bytes_per_s
    return nbytes / rate if rate else 0.0


def _relay(compute_s: float, transfer_s: float, overlap: bool) -> float:
    """A part's time: its compute and its transfer overlap with prefetch, else they add up."""
    return max(compute_s, transfer_s) if overlap else compute_s + transfer_s


def _eps_exposed(shape: Shape, facts: ModelFacts, profile: Profile, t: Timings, backward_s: float, sharded: bool):
    """The eager param server's updates and (replicas) gradient sums not hidden by the backward.

    On a GPU machine both run on the host and the links beside the device's backward of the
    parts below; what outlasts the backward (at least the embeddings' own update and sum, the
    last to start) is exposed. On a CPU they run on the cores the backward uses: all of it
    counts. A sharded EPS updates each part once, on its owner: a worker's share is 1 / w.
    """
    share = 1 / shape.replicas if sharded else 1.0
    update_embed, updates = _eps_updates_s(facts, profile, t)
    sums = last_sum = 0.0
    if shape.replicas > 1:
        bw = _allreduce_bandwidth(shape.replicas, profile)
        sums = _allreduce_s(facts.params * facts.weight_bytes, shape.replicas, bw,
                            profile.link_latency_s * (facts.num_layers + 2))
        last_sum = _allreduce_s(facts.embed_params * facts.weight_bytes, shape.replicas, bw, profile.link_latency_s)
    if profile.device_type == "cpu":
        return updates * share, sums
    return max(update_embed * share, updates * share - backward_s), max(last_sum, sums - backward_s)


def _eps_updates_s(facts: ModelFacts, profile: Profile, t: Timings) -> tuple[float, float]:
    """Seconds of the embeddings' update, and of every part's: on a CPU the optimizer steps timed
    with the worker's threads, on a GPU machine the host's optimizer rate."""
    ends = facts.embed_params + facts.head_params
    if profile.device_type == "cpu":
        embed = t.optimizer_ends_s * facts.embed_params / max(ends, 1)
        return embed, facts.num_layers * t.optimizer_block_s + t.optimizer_ends_s
    per_param = profile.host_optimizer_s_per_param
    return facts.embed_params * per_param, facts.params * per_param


def l2l_paper_step_s(num_layers: int, u: int, c: float, x: float) -> float:
    """Equation 4 of the L2L paper: N (u C + X) forward + N (3 u C + X) recompute and backward."""
    return num_layers * (4 * u * c + 2 * x)


def l2l_transfer_overhead(u: int, c: float, x: float) -> float:
    """The share of an L2L step spent on transfers, from equation 6: 2X / (4uC + 2X).

    1 when nothing computes, X / (2C + X) without inner looping (u = 1), and falling to 0 as
    u grows: the inner loop amortises each block's transfer over u micro-batches."""
    return 2 * x / (4 * u * c + 2 * x)


# --------------------------------------------------------------------------- pipelines


def pipeline_cost(shape: Shape, facts: ModelFacts, profile: Profile, t: Timings) -> StepCost:
    """PipeDream-2BW's THROUGHPUT(.) for one minibatch of m micro-batches on d stages x w replicas."""
    m, d = shape.num_microbatches, shape.stages
    per_stage = stage_times(shape, facts, t)
    exchange = _p2p_s(shape, facts, profile) if d > 1 else 0.0
    slot = [max(comp, exchange) for comp in per_stage]
    if shape.strategy == "pipe_2bw":
        pipeline = m * max(slot)
    else:
        pipeline = sum(slot) + (m - 1) * max(slot)
    sums = _stage_allreduce_s(shape, facts, profile)
    exposed_sums = max(0.0, sums - pipeline) if shape.strategy == "pipe_2bw" else sums
    optimizer = max(_stage_optimizer_s(shape, facts, t))
    if profile.device_type == "cpu":
        exposed_sums = sums  # the cores that compute also sum
    parts = {"compute": m * max(per_stage), "bubble": pipeline - m * max(slot),
             "activations exchange": 2 * m * exchange, "gradient sums (exposed)": exposed_sums,
             "optimizer": optimizer}
    notes = [f"bubble (d-1)/(m+d-1) = {(d - 1) / (m + d - 1):.2f}"] if shape.strategy != "pipe_2bw" else []
    return StepCost(pipeline + exposed_sums + optimizer, parts, notes)


def stage_blocks(shape: Shape, facts: ModelFacts) -> list[int]:
    return [len(r) for r in partition(facts.num_layers, shape.stages)]


def stage_times(shape: Shape, facts: ModelFacts, t: Timings) -> list[float]:
    """T_i^comp: each stage's forward + backward (+ recompute) seconds for one micro-batch."""
    b = shape.microbatch_size
    block, embed, head = t.part("block", b), t.part("embed", b), t.part("head", b)
    counts = stage_blocks(shape, facts)
    times = []
    for i, blocks in enumerate(counts):
        first, last = i == 0, i == len(counts) - 1
        work = blocks * _both(block) + (_both(embed) if first else 0.0) + (_both(head) if last else 0.0)
        if shape.recompute == "block":
            work += blocks * block.forward_s
        elif shape.recompute == "stage":
            work += blocks * block.forward_s + (embed.forward_s if first else 0.0) + (head.forward_s if last else 0.0)
        times.append(work)
    return times


def _p2p_s(shape: Shape, facts: ModelFacts, profile: Profile) -> float:
    """One micro-batch's activation to the next stage (its gradient comes back the same way)."""
    spans_nodes = shape.workers > profile.devices_per_node
    bw = profile.inter_node_bytes_per_s if spans_nodes else profile.stage_link_bytes_per_s
    return facts.boundary_bytes(shape.microbatch_size) / bw + profile.link_latency_s


def _stage_params(shape: Shape, facts: ModelFacts) -> list[int]:
    counts = stage_blocks(shape, facts)
    last = len(counts) - 1
    return [n * facts.block_params + (facts.embed_params if i == 0 else 0) + (facts.head_params if i == last else 0)
            for i, n in enumerate(counts)]


def _stage_allreduce_s(shape: Shape, facts: ModelFacts, profile: Profile) -> float:
    if shape.replicas == 1:
        return 0.0
    bw = _allreduce_bandwidth(shape.replicas, profile)
    return max(_allreduce_s(p * FP32, shape.replicas, bw, profile.link_latency_s) for p in _stage_params(shape, facts))


def _stage_optimizer_s(shape: Shape, facts: ModelFacts, t: Timings) -> list[float]:
    counts = stage_blocks(shape, facts)
    ends_share = t.optimizer_ends_s / max(facts.embed_params + facts.head_params, 1)
    last = len(counts) - 1
    return [n * t.optimizer_block_s + ends_share * ((facts.embed_params if i == 0 else 0)
                                                     + (facts.head_params if i == last else 0))
            for i, n in enumerate(counts)]


def _allreduce_bandwidth(replicas: int, profile: Profile) -> float:
    """bwth_width(w) of §4.2.1: the node's links while the replicas fit in one node."""
    return profile.allreduce_bytes_per_s if replicas <= profile.devices_per_node else profile.inter_node_bytes_per_s


def _allreduce_s(nbytes: float, replicas: int, bus_bytes_per_s: float, latency_s: float) -> float:
    """A ring all-reduce: 2 (w - 1) / w of the bytes cross each link, 2 (w - 1) hops of latency."""
    return 2 * (replicas - 1) / replicas * nbytes / bus_bytes_per_s + 2 * (replicas - 1) * latency_s


# --------------------------------------------------------------------------- MEMORY(.)


def closed_form_bytes(shape: Shape, facts: ModelFacts) -> int:
    """MEMORY(.) of PipeDream-2BW §4.2.2, extended to every strategy: the device bytes of the
    fullest worker, from weights, gradients, optimizer state and in-flight activations.

    Pipelines: stage i keeps v |W_i| of weights (v = 2 for 2BW), |W_i| of gradients and its
    optimizer state, and the activations of its in-flight micro-batches (1F1B: min(d - i, m);
    GPipe: m): all of them without recompute, their inputs with recompute (plus one
    micro-batch's worth while recomputing). The baseline is one stage with one in flight.
    L2L: two resident parts with their gradients, the stash (device: every block's input for
    every micro-batch), one block's activations, the head's gradients per micro-batch.
    """
    b, m = shape.microbatch_size, shape.num_microbatches
    if shape.strategy in RELAYS:
        return _l2l_bytes(shape, facts)
    counts = stage_blocks(shape, facts) if shape.strategy in PIPELINES else [facts.num_layers]
    params = _stage_params(shape, facts) if shape.strategy in PIPELINES else [facts.params]
    versions = 2 if shape.strategy == "pipe_2bw" else 1
    fullest = 0
    for i, (blocks, p) in enumerate(zip(counts, params, strict=True)):
        in_flight = m if shape.strategy == "pipe_gpipe" else min(len(counts) - i, m)
        last = i == len(counts) - 1
        per_microbatch = blocks * facts.block_activation_bytes(b) + (facts.head_activation_bytes(b) if last else 0)
        if shape.recompute == "none":
            activations = in_flight * per_microbatch
        elif shape.recompute == "block":
            activations = in_flight * blocks * facts.boundary_bytes(b) + facts.block_activation_bytes(b)
        else:
            activations = in_flight * facts.boundary_bytes(b) + per_microbatch
        state = p * FP32 * (versions + 1 + facts.state_words)
        fullest = max(fullest, state + activations)
    return int(fullest)


def _l2l_bytes(shape: Shape, facts: ModelFacts) -> int:
    b, u = shape.microbatch_size, shape.num_microbatches
    largest_part = max(facts.embed_params, facts.block_params, facts.head_params)
    resident = 2 * largest_part * facts.weight_bytes * 2  # two parts, weights and gradients
    entries = 2 if shape.strategy == "l2l_stash_cpu" else u * facts.num_layers
    in_flight = (entries + u) * facts.boundary_bytes(b)  # the stash, and the gradients travelling down
    return int(resident + in_flight + facts.block_activation_bytes(b) + facts.head_activation_bytes(b))


def eps_host_bytes(shape: Shape, facts: ModelFacts, sharded: bool) -> int:
    """L2L's eager param server on one worker's host: the fp32 masters; their gradients and
    optimizer state (sharded over the replicas: on each part's owner only); the stash where it
    lives on the host. On a CPU this is the same memory the dry run's "device" figure counts."""
    share = shape.replicas if sharded and shape.replicas > 1 else 1
    state = facts.params * FP32 * (1 + (1 + facts.state_words) / share)
    stash = facts.num_layers * shape.num_microbatches * facts.boundary_bytes(shape.microbatch_size)
    return int(state + (stash if shape.strategy == "l2l_stash_cpu" else 0))
