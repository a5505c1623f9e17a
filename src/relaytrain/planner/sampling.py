"""An online objective's sampling in a plan: each rollout batch's predicted seconds
(`cost.rollout.sampling_cost`), a step's share of them added to the step the strategy's cost
model predicts for the update, where the run would sample, and the cache it holds."""

from __future__ import annotations

import statistics

import torch

from relaytrain.cost.formulas import ModelFacts, StepCost
from relaytrain.cost.profile import PART_BUDGET_S, REPEATS, DecodeTimes, Profile, median_s, sample_microbatch
from relaytrain.cost.rollout import SamplingCost, kv_cache_bytes, placement, sampling_cost, weight_bytes
from relaytrain.models.layered import LayeredModel
from relaytrain.rollout.on_device import decoder_layer_names
from relaytrain.rollout.sampling import Sampling, sample
from relaytrain.run.resolve import choose
from relaytrain.step.precision import Precision

TOKENS = 16  # decoded tokens `time_decode` times (less the first, which the prompt pass makes)

# objective.rollout_placement's choices taken as asked (auto: the run's rule, `placement`; host:
# decoding on the host's cores beside a GPU, which no GPU profile times, is not predicted)
ASKED = ("copy", "relay")


def free_between_steps(device_bytes: float | None, facts: ModelFacts) -> int | None:
    """What a host-held policy's copy may take of a device of `device_bytes`: a rollout batch is
    made between steps, when L2L's device holds its relay's two blocks and no activations (the
    run asks the device itself, `rollout.on_device.free_bytes`)."""
    return None if device_bytes is None else int(device_bytes - 2 * facts.block_params * facts.weight_bytes)


def sampling_for(cfg, cls, facts: ModelFacts, profile: Profile, workers: int, free: int | None
                 ) -> SamplingCost | None:
    """`cfg`'s rollout batch on `profile`, sampled by the first of `workers` processes for every
    replica's prompts; `free`: the device bytes a host-held policy's copy may take
    (`free_between_steps`). None: the objective samples nothing, or the placement asked for is
    not predicted."""
    goal = choose(cfg).objective
    if not goal.learns_online or goal.rollout_placement == "host" or profile.memory_bytes_per_s is None:
        return None
    s = cfg.strategy
    rows = facts.rows(s.microbatch_size * cls.replicas(cfg))  # a micro-batch of every replica's prompts
    timings = profile.for_workers(workers, int(cfg.train.threads))
    cache = kv_cache_bytes(facts, rows, facts.seq_len)
    # L2L's policy, or the whole model that shards and stages gather on the first process's host
    host_held = cls.capabilities.host_held_policy or not cls.rank_layout(cfg).replicates_whole
    if host_held and profile.device_type != "cpu" and goal.rollout_placement in ASKED:
        where = goal.rollout_placement
    else:
        where = placement(host_held, profile.device_type, weight_bytes(facts), cache, free)
    return sampling_cost(facts, timings.part("block", rows).forward_s, timings.part("head", rows).forward_s,
                         profile.memory_bytes_per_s, profile.host_to_device_bytes_per_s, rows=rows,
                         microbatches=s.num_microbatches, completion_tokens=goal.max_completion_length,
                         scoring_passes=int(goal.num_iterations > 1) + int(goal.beta != 0), where=where,
                         decode_at=timings.decode_at)


@torch.no_grad()
def time_decode(model: LayeredModel, cfg, b: int, precision: Precision, device: torch.device) -> DecodeTimes:
    """A decoded token of `b` sequences on this machine (`profile.DecodeTimes`, a measured
    profile's `profile.DecodeTimer`): the rollout engine's decode step (`sampling.sample`, the
    time of TOKENS + 1 tokens less that of 1, over TOKENS, after a prompt of half of
    data.seq_len) of the one-block model, and of the same model with its block taken out (the
    rest of the step); the block's call is their difference. The two alternate, round by round,
    so that the machine's drift falls on both; each is the median of its rounds."""
    hf_model = model.hf_model.eval()
    prompts = sample_microbatch(cfg, b, device).input_ids[:, :max(1, cfg.data.seq_len // 2)].tolist()
    layers = decoder_layer_names(hf_model)[0].rpartition(".")[0]  # the model's list of its (one) layer
    kept = hf_model.get_submodule(layers)

    def step_s() -> float:
        def decode(tokens: int):
            return lambda: sample(hf_model, prompts, list(range(b)), Sampling(), tokens, set(), 0, device,
                                  precision.autocast_context(device))
        return (median_s(decode(TOKENS + 1), device, repeats=1) - median_s(decode(1), device, repeats=1)) / TOKENS

    # A large model's step on a CPU takes seconds: one round then, not REPEATS.
    rounds = REPEATS if step_s() * TOKENS < PART_BUDGET_S else 1
    whole, rest = [], []
    try:
        for _ in range(rounds):
            whole.append(step_s())
            hf_model.set_submodule(layers, torch.nn.ModuleList())
            rest.append(step_s())
            hf_model.set_submodule(layers, kept)
    finally:
        hf_model.set_submodule(layers, kept)
    block, rest_s = statistics.median(w - r for w, r in zip(whole, rest, strict=True)), statistics.median(rest)
    return DecodeTimes(max(0.0, block), rest_s, reads_cache=True)


def with_sampling(cost: StepCost, sampling: SamplingCost | None, cfg) -> StepCost:
    """The update's step and a step's share of its rollout batch (num_iterations steps share one)."""
    if sampling is None:
        return cost
    iterations = int(cfg.objective.num_iterations)
    share = sampling.per_step(iterations)
    note = (f"sampling: {sampling.batch_s:.3g} s a rollout batch ({WHERE_SAID[sampling.where]}"
            + (f"; {iterations} steps share it)" if iterations > 1 else ")"))
    return StepCost(cost.step_s + share, {**cost.parts, "sampling": share}, [*cost.notes, note])


WHERE_SAID = {"device": "where the model is", "copy": "a device copy of the host-held policy",
              "relay": "its blocks relayed through the device once a token"}
