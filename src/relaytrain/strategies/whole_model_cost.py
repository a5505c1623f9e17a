"""The closed-form cost of the strategies that run the whole model on every worker: the
baseline (plain data parallelism, DDP) and FSDP.

Each worker computes every part on its share of every micro-batch (`whole_model_compute`); the
two differ in what a worker holds and what crosses between workers: the baseline keeps the whole
model and all-reduces its gradients once a step, FSDP keeps 1/R of everything and gathers the
units before they compute. Each is a cost model of its own (`BaselineCost`, `FsdpCost`), which
its strategy class names (`cost_model = BaselineCost`): the runtime and the prediction each have
their own file. Every figure is a prediction; the shared formulas are `relaytrain.cost.formulas`'s.

Both take tensor parallelism (`strategy.tensor_parallel=T`, `WholeModelCost`): a worker is then
one of T tensor ranks of its replica, priced with the facts of one (`ModelFacts.split`: 1/T of
every block's matrices, their state and work, and of the activations inside attention and the
MLP), plus the two all-reduces of a block's activations each way that the split adds
(`tensor_allreduces_s`). The gradient sums and FSDP's shards then run over the R (or R x S)
workers that hold the same part of a block, not over every worker (`data_workers`).
"""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from relaytrain.cost.formulas import (
    FP32,
    ModelFacts,
    Shape,
    StepCost,
    both,
    cpu_activation_bytes,
    microbatch_rows,
    optimizer_s,
    powers_of_two_dividing,
    stage_bytes,
    worker_tokens,
)
from relaytrain.cost.links import all_to_all_s, allreduce_s, upload_s
from relaytrain.cost.model import CostModel, weights_grads_optimizer_bytes
from relaytrain.cost.profile import PartTimes, Profile
from relaytrain.cost.work import expert_weights, one_block_on_meta
from relaytrain.models import adapter as adapters
from relaytrain.placement.tensor_parallel import block_plan, tensor_parallel
from relaytrain.schema.config import Offload, Recompute
from relaytrain.step.optim import state_words
from relaytrain.strategies.stash import Stash, stash_on_host
from relaytrain.utils.errors import ConfigError

WORKER_OVERHEAD_BYTES = int(0.5 * 2**30)  # Python, torch and transformers in each worker process
BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket: one all-reduce message each
GATHERED_BLOCKS = 2  # FSDP: a block computing and the next one prefetched, gathered at once
IN_TRANSIT = 2  # a host stash's entries on the device at once: the one computing and the one prefetched
# What the planner tries of recompute and the stash: the host stash needs block recompute.
RECOMPUTE_AND_STASH = ((Recompute.none, Stash.device), (Recompute.block, Stash.device), (Recompute.block, Stash.host))


def recomputes_blocks(cfg) -> bool:
    """`strategy.recompute=block`: each block's input kept, the block recomputed in backward."""
    return cfg.strategy.recompute == Recompute.block


def whole_model_compute(cfg, facts: ModelFacts, profile: Profile, recomputes: bool, workers: int):
    """A data-parallel worker's compute in a step (the baseline's and FSDP's), one of `workers`
    running at once: every micro-batch of its share through the embeddings, every block (block
    recompute: one more forward each) and the head. Returns the seconds, the profiled parts and
    the recompute per block."""
    s, n = cfg.strategy, facts.num_layers
    t = profile.for_workers(workers, cfg.train.threads)
    block, embed, head = (facts.part_times(t, part, s.microbatch_size) for part in ("block", "embed", "head"))
    recompute = block.forward_s if recomputes else 0.0
    compute = s.num_microbatches * (both(embed) + n * (both(block) + recompute) + both(head))
    return compute, t, (embed, block, head), recompute


def stashed_inputs(cfg) -> int | None:
    """Block inputs on the device with block recompute: those in transit with a host stash (None:
    every block's)."""
    return IN_TRANSIT if stash_on_host(cfg.strategy) else None


def host_stash_bytes(cfg, facts: ModelFacts) -> int:
    """A host stash's entries waiting in host memory: every block's input of one micro-batch (of
    the worker's tokens, `facts.tokens`)."""
    return facts.num_layers * facts.boundary_bytes(cfg.strategy.microbatch_size) if stash_on_host(cfg.strategy) else 0


def host_stash_s(cfg, facts: ModelFacts, profile: Profile, block: PartTimes) -> float:
    """The host stash's copies a step leaves exposed: each block's input goes down while the block
    above it computes forward, and comes up while the block above recomputes and backpropagates
    (prefetch); what a copy outlasts is exposed. On a CPU nothing crosses."""
    s = cfg.strategy
    x = upload_s(facts.boundary_bytes(s.microbatch_size), profile)
    hidden_behind = max(0.0, x - block.forward_s) + max(0.0, x - 2 * block.forward_s - block.backward_s)
    return s.num_microbatches * facts.num_layers * hidden_behind


def _extra_workers_bytes(workers: int) -> int:
    """The interpreters of a data-parallel run's workers: none apart from the run's own with one."""
    return workers * WORKER_OVERHEAD_BYTES if workers > 1 else 0


# --------------------------------------------------------------------------- tensor parallelism


class WholeModelCost(CostModel):
    """What the whole-model placements share: each replica's blocks split over T tensor ranks."""

    def degrees(self, cfg, workers: int, family) -> dict[str, list[int]]:
        """Every T > 1 dividing `workers` that the model's blocks split over (`split_refusal`; the
        strategy's checks of each shape's keys come after, `refusal`)."""
        sizes = [size for size in range(2, workers + 1) if workers % size == 0 and split_refusal(cfg, family, size) is None]
        return {**super().degrees(cfg, workers, family), "tensor_parallel": sizes}

    def refusal(self, cfg, family, **keys) -> str | None:
        """Blocks split: the run's check of the model's blocks (`split_refusal`), then the
        strategy's checks."""
        size = int(keys.get("tensor_parallel", 1))
        return (split_refusal(cfg, family, size) if size > 1 else None) or super().refusal(cfg, family, **keys)

    def data_workers(self, cfg) -> int:
        """The workers holding the same part of every block, whose gradients are summed (FSDP:
        among which it shards): the run's processes but a replica's other tensor ranks."""
        return self.strategy.processes(cfg) // tensor_parallel(cfg.strategy)

    def variants(self, cfg, family, shapes: list[Shape]) -> list[Shape]:
        """Each shape of w >= 2 data-parallel workers (the baseline's replicas, FSDP's shards), and
        its workers sharing a mixture's experts in groups of every E >= 2 that divides w and the
        experts (`strategy.expert_parallel`), where the run takes it with the shape's other keys."""
        experts = cfg.model.num_experts or 0
        shares = [shape for shape in shapes if experts and not shape.placement]
        taken = {(replicas, options): [size for size in range(2, replicas + 1) if replicas % size == 0
                                       and experts % size == 0 and self.refusal(
                                           cfg, family, replicas=replicas, expert_parallel=size, **dict(options)) is None]
                 for replicas, options in {(shape.replicas, shape.options) for shape in shares}}
        return shapes + [dataclasses.replace(shape, options=(*shape.options, ("expert_parallel", str(size))))
                         for shape in shares for size in taken[shape.replicas, shape.options]]


def split_refusal(cfg, family, size: int) -> str | None:
    """Why a run of `cfg` cannot split its blocks over `size` tensor ranks, in the run's own words
    (`placement.tensor_parallel.block_plan`: a plan for the family, whole heads, key/value heads
    and MLP width on every rank, no experts, asked of the model built with one block on the meta
    device; `family`: the run's, resolved); None where it can. An adapter or a 4-bit base is
    refused as the run refuses their wrapped layers."""
    m = cfg.model
    if adapters.enabled(cfg.adapter) or str(getattr(m, "quantize", "none")) != "none":
        return "strategy.tensor_parallel does not split adapter-wrapped or 4-bit layers yet; set it to 1"
    try:
        block_plan(_one_block(m, family), family, size)
    except ConfigError as refused:
        return str(refused)
    return None


_last_block: dict[str, object] = {}  # the last model asked of (`split_refusal`): the planner asks it per size


def _one_block(m, family):
    key = f"{family.name}\n{OmegaConf.to_yaml(m)}"
    if key not in _last_block:
        _last_block.clear()
        _last_block[key] = one_block_on_meta(m, family=family)
    return _last_block[key]


def tensor_allreduces_s(cfg, facts: ModelFacts, profile: Profile) -> float:
    """A tensor rank's all-reduces in a step (Megatron's f and g): per micro-batch and block, two
    in the forward (attention's and the MLP's partial outputs summed) and two in the backward
    (their inputs' gradients), two more where the block is recomputed; each of the block's
    activations for the micro-batch (its rows x tokens x hidden at the activations' bytes) over
    the T ranks at the collectives' rate (`allreduce_s`). The next layer waits for each: exposed."""
    s = cfg.strategy
    passes = s.num_microbatches * facts.num_layers * (3 if recomputes_blocks(cfg) else 2)
    activations = facts.rows(s.microbatch_size) * facts.tokens * facts.hidden * facts.activation_bytes
    return passes * 2 * allreduce_s(activations, facts.tensor_parallel, profile)


def add_placement_collectives(parts: dict[str, float], cfg, facts: ModelFacts, profile: Profile) -> None:
    """A step's parts, with the all-reduces of a tensor rank (`tensor_allreduces_s`) where blocks
    split, and the all-to-alls of an expert group (`expert_exchanges_s`) where experts are shared."""
    if facts.tensor_parallel > 1:
        parts["tensor all-reduces"] = tensor_allreduces_s(cfg, facts, profile)
    if facts.expert_parallel > 1:
        parts["expert all-to-alls"] = expert_exchanges_s(cfg, facts, profile)


def expert_exchanges_s(cfg, facts: ModelFacts, profile: Profile) -> float:
    """Expert parallelism's all-to-alls a step (`placement/experts.py`): in every routed block, each
    micro-batch's picks (rows x tokens x top-k hidden states) go to their experts' holders and come
    back, forward and backward (and again in a recompute), each exchange three calls (the counts,
    the experts, the rows); nothing overlaps them. Every block is counted as routed (an upper bound
    for a mixture with dense first layers)."""
    s = cfg.strategy
    picks = facts.rows(s.microbatch_size) * facts.tokens * cfg.model.experts_per_token
    nbytes = picks * facts.hidden * facts.activation_bytes
    passes = 2 * (3 if recomputes_blocks(cfg) else 2)  # there and back, forward, backward (recompute)
    calls = facts.num_layers * s.num_microbatches * passes
    return calls * all_to_all_s(nbytes, facts.expert_parallel, profile, messages=3)


# --------------------------------------------------------------------------- the baseline


class BaselineCost(WholeModelCost):
    """The baseline's answers (`strategies/baseline.py`): Algorithm 1 on every replica."""

    def shapes(self, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """Any number of replicas w that divides the batch (one worker each), every micro-batch size
        b of a worker's share (m = batch / (w b)), with and without block recompute, the
        recomputed blocks' inputs on the device or the host."""
        return [Shape(self.strategy.name, b, batch // (w * b), w, 1, str(recompute), self.shape_options(stash=stash))
                for w in range(1, workers + 1) if batch % w == 0
                for b in powers_of_two_dividing(batch // w) for recompute, stash in RECOMPUTE_AND_STASH]

    def recomputes(self, cfg) -> bool:
        return recomputes_blocks(cfg)

    def step_cost(self, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """L2L paper, Algorithm 1: per micro-batch, the embeddings, every block and the head
        forward and backward (block recompute: one more forward per block); then one optimizer
        step over the whole model. With replicas, the all-reduce of every gradient, in buckets
        during the last micro-batch's backward: what outlasts that backward is exposed (on a
        CPU all of it: the cores that compute also sum). Split blocks: a tensor rank's share,
        its gradients summed over the workers holding the same share, and its all-reduces."""
        facts = facts.placed(cfg.strategy)
        n, workers = facts.num_layers, self.strategy.processes(cfg)  # R, or R x S (x T)
        compute, t, (embed, block, head), recompute = whole_model_compute(cfg, facts, profile, recomputes_blocks(cfg),
                                                                          workers)
        optimizer = optimizer_s(t, facts, n, embed=True, head=True)
        parts = {"compute": compute, "optimizer": optimizer}
        if stash_on_host(cfg.strategy):
            parts["stash transfers (exposed)"] = host_stash_s(cfg, facts, profile, block)
        summed = self.data_workers(cfg)
        if summed > 1:
            # The gradients of what trains, over every replica; a worker's share of experts shared
            # out only over the R/E replicas holding the same share.
            shared = shared_expert_grads(facts)
            nbytes = (facts.trained_params - shared) * FP32
            sums = allreduce_s(nbytes, summed, profile, messages=-(-nbytes // BUCKET_BYTES), span=workers)
            holders = summed // facts.expert_parallel
            if shared and holders > 1:
                sums += allreduce_s(shared * FP32, holders, profile, messages=-(-shared * FP32 // BUCKET_BYTES),
                                    span=workers)
            last_backward = embed.backward_s + n * (block.backward_s + recompute) + head.backward_s
            parts["gradient sums (exposed)"] = sums if profile.device_type == "cpu" else max(
                allreduce_s(min(nbytes, BUCKET_BYTES), summed, profile, span=workers), sums - last_backward)
        add_placement_collectives(parts, cfg, facts, profile)
        return StepCost(sum(parts.values()), parts)

    def device_bytes(self, cfg, facts: ModelFacts) -> int:
        """The whole model as one stage with one micro-batch in flight (a host stash: the block
        inputs in transit); split blocks: a tensor rank's share of them."""
        facts = facts.placed(cfg.strategy)
        return stage_bytes(facts, cfg.strategy.microbatch_size, facts.num_layers, facts.params, last=True,
                           in_flight=1, versions=1, recompute=str(cfg.strategy.recompute),
                           stashed_inputs=stashed_inputs(cfg))

    def host_state_bytes(self, cfg, facts: ModelFacts) -> int:
        """A host stash's block inputs (`strategy.stash=host`); otherwise nothing apart from the device's."""
        return host_stash_bytes(cfg, facts)

    def estimate_host_bytes(self, cfg, num_params: int, device_type: str) -> int:
        """Every replica's weights, gradients and optimizer state, and one micro-batch at a time:
        every block's activations, or (recompute) one block's and every block's input (on the
        host with a host stash, wherever the device is)."""
        live, stash = (1, cfg.model.num_layers) if recomputes_blocks(cfg) else (cfg.model.num_layers, 0)
        per_worker = weights_grads_optimizer_bytes(cfg, num_params) + cpu_activation_bytes(cfg, device_type, live, stash)
        per_worker += _host_stash_estimate(cfg, device_type)
        workers = self.strategy.processes(cfg)  # R x S where sequences are cut: each a whole model
        return workers * per_worker + _extra_workers_bytes(workers)


def shared_expert_grads(facts: ModelFacts) -> int:
    """The gradients of a worker's share of every block's experts where they are shared out
    (`ModelFacts.share_experts`): the experts' own where they train in full, LoRA's factors on them
    where an adapter adapts them (already cut to the share), none where LoRA leaves them frozen.
    The run sums these over the workers holding the same share alone (`ExpertShards.holds`)."""
    if facts.expert_parallel == 1:
        return 0
    if facts.trained_parts is not None:
        return facts.num_layers * facts.trained_parts.block_experts
    return facts.num_layers * (expert_weights(facts.shape) // facts.expert_parallel)


# --------------------------------------------------------------------------- FSDP


class FsdpCost(WholeModelCost):
    """FSDP's answers (`strategies/fsdp.py`): the baseline's compute on 1/R of the state, and the
    gathers and reduce-scatters that sharding adds."""

    def shapes(self, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """Any number of workers w that divides the batch (2 or more: one worker shards nothing),
        every micro-batch size of a worker's share, with and without block recompute (its inputs on
        the device or the host), resharding after forward or not, the shards on the device or the host."""
        return self.sharded_shapes(range(2, workers + 1), batch)

    def shapes_to_place(self, replicas: int, batch: int, num_layers: int, degrees: dict[str, int]) -> list[Shape]:
        """From one replica up where sequences are cut (its S workers shard the model between
        them); from two where only blocks split (a replica's tensor ranks hold different parts:
        FSDP shards among the replicas)."""
        first = 1 if degrees.get("sequence_parallel", 1) > 1 else 2
        return self.sharded_shapes(range(first, replicas + 1), batch)

    def sharded_shapes(self, replicas: range, batch: int) -> list[Shape]:
        """`shapes` for each of these numbers of replicas."""
        return [Shape(self.strategy.name, b, batch // (w * b), w, 1, str(recompute),
                      self.shape_options(reshard_after_forward=reshard, offload=offload, stash=stash))
                for w in replicas if batch % w == 0
                for b in powers_of_two_dividing(batch // w)
                for recompute, stash in RECOMPUTE_AND_STASH
                for reshard in (True, False) for offload in Offload]

    def recomputes(self, cfg) -> bool:
        return recomputes_blocks(cfg)

    def step_cost(self, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """The baseline's compute on each worker's share, plus FSDP's traffic: every micro-batch
        all-gathers every parameter for its forward and (resharding) again for its backward, or
        without resharding once a step, and each step reduce-scatters the gradients once. On a GPU
        the gathers overlap the compute of the unit before them (prefetch): what outlasts the
        compute is exposed, and one unit's gather at least; on a CPU the cores that compute also
        move the bytes: all of it counts. Offload adds each gather's upload of the shards and the
        optimizer step on the host. Split blocks: a tensor rank's share, sharded among the workers
        holding the same share, and its all-reduces."""
        s = cfg.strategy
        facts = facts.placed(s)
        n, processes, w = facts.num_layers, self.strategy.processes(cfg), self.data_workers(cfg)  # w: R, or R x S
        compute, t, (_, block, _), _ = whole_model_compute(cfg, facts, profile, recomputes_blocks(cfg), processes)
        # A ring all-gather or reduce-scatter moves half an all-reduce's bytes (NCCL). gloo's
        # all-gather takes its all-reduce's time, measured, and its reduce-scatter runs as one
        # (ReduceScatterByAllReduce): on a CPU each costs a whole all-reduce.
        share = 1.0 if profile.device_type == "cpu" else 0.5
        gather = allreduce_s(facts.whole(facts.device_part_bytes), w, profile, messages=n + 1, span=processes) * share
        gathers = 2 * s.num_microbatches if s.reshard_after_forward else 1
        traffic = gathers * gather + allreduce_s(facts.trained_params * FP32, w, profile, messages=n + 1,
                                                 span=processes) * share
        offloaded = s.offload == Offload.host
        if offloaded:
            traffic += gathers * upload_s(facts.built_bytes(compact_base=False) / w, profile)
        if profile.device_type == "cpu":
            exposed = traffic
        else:
            exposed = max(traffic - compute, gather / (n + 1))
        optimizer = (facts.trained_params * profile.host_optimizer_s_per_param if offloaded
                     else optimizer_s(t, facts, n, embed=True, head=True)) / w
        parts = {"compute": compute, "gathers and reduce-scatters (exposed)": exposed, "optimizer": optimizer}
        if stash_on_host(cfg.strategy):
            parts["stash transfers (exposed)"] = host_stash_s(cfg, facts, profile, block)
        add_placement_collectives(parts, cfg, facts, profile)
        return StepCost(sum(parts.values()), parts)

    def device_bytes(self, cfg, facts: ModelFacts) -> int:
        """1/R of the weights, gradients and optimizer state (none with offload), the units
        gathered at once (the root's embeddings and head and the blocks around the one computing;
        without resharding every block, from its forward to its backward), and one micro-batch's
        activations as the baseline keeps them; split blocks: of a tensor rank's share; experts
        shared out (`strategy.expert_parallel=E`): 1/R of them all the same, and 1/E gathered."""
        s = cfg.strategy
        whole, facts = facts, facts.placed(s)
        activations = stage_bytes(facts, s.microbatch_size, facts.num_layers, 0, last=True, in_flight=1,
                                  versions=0, recompute=str(s.recompute), stashed_inputs=stashed_inputs(cfg))
        state = _sharded_state_bytes(whole.placed(s, share_experts=False))  # every expert, shared out or not
        shards = 0 if s.offload == Offload.host else state / self.data_workers(cfg)
        return int(shards + gathered_bytes(cfg, facts) + activations)

    def host_state_bytes(self, cfg, facts: ModelFacts) -> int:
        """With `strategy.offload=host` (CPUOffloadPolicy), a worker's 1/R of the fp32 weights,
        gradients and optimizer state; with a host stash, its block inputs."""
        stash = host_stash_bytes(cfg, facts)
        if cfg.strategy.offload != Offload.host:
            return stash
        return int(_sharded_state_bytes(facts.placed(cfg.strategy)) / self.data_workers(cfg)) + stash

    def estimate_host_bytes(self, cfg, num_params: int, device_type: str) -> int:
        """Every worker builds the whole model once before sharding it; then it keeps its shards
        (on the host when the device is the host, or with offload) and one micro-batch's activations."""
        s, m, workers = cfg.strategy, cfg.model, self.strategy.processes(cfg)  # R x S where sequences are cut
        live, stash = (1, m.num_layers) if recomputes_blocks(cfg) else (m.num_layers, 0)
        shards = num_params * FP32 * (2 + state_words(cfg.optim)) / workers
        on_host = shards if device_type == "cpu" or s.offload == Offload.host else 0
        per_worker = num_params * FP32 + on_host + cpu_activation_bytes(cfg, device_type, live, stash)
        per_worker += _host_stash_estimate(cfg, device_type)
        return int(workers * per_worker + _extra_workers_bytes(workers))


def _host_stash_estimate(cfg, device_type: str) -> int:
    """A host stash's inputs in host memory beside a device (on a CPU `cpu_activation_bytes` counts them)."""
    if device_type == "cpu" or not stash_on_host(cfg.strategy):
        return 0
    m, s = cfg.model, cfg.strategy
    return m.num_layers * microbatch_rows(cfg) * worker_tokens(cfg.data.seq_len, s) * m.hidden_size * FP32


def _sharded_state_bytes(facts: ModelFacts) -> int:
    """What FSDP shards: every weight as built (fp32, a 4-bit base's storage at its bytes), and the
    gradients and optimizer state of what trains."""
    return facts.built_bytes(compact_base=False) + facts.trained_params * (1 + facts.state_words) * FP32


def gathered_bytes(cfg, facts: ModelFacts) -> int:
    """FSDP's units gathered at the peak, in bytes: floating weights where they compute, a 4-bit
    base's storage as it is (gathered, like any parameter, as stored)."""
    return gathered_params(cfg, facts.device_part_bytes(0) + facts.device_part_bytes(2), facts.device_part_bytes(1),
                           facts.num_layers)


def unit_bytes(module, param_bytes: int) -> int:
    """A unit's parameters as FSDP gathers them: floating ones at `param_bytes`, a 4-bit base's
    uint8 storage at its own bytes."""
    return sum(p.numel() * (param_bytes if p.is_floating_point() else p.element_size()) for p in module.parameters())


def gathered_params(cfg, ends: int, block: int, num_layers: int) -> int:
    """FSDP's parameters held whole at the peak: the root's, and the gathered blocks (counted in
    parameters or in bytes, as `ends` and `block` are)."""
    blocks = min(GATHERED_BLOCKS, num_layers) if cfg.strategy.reshard_after_forward else num_layers
    return ends + blocks * block
