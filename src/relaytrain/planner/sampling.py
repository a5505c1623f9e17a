"""An online objective's sampling in a plan: each rollout batch's predicted seconds
(`cost.rollout.sampling_cost`), a step's share of them added to the step the strategy's cost
model predicts for the update, where the run would sample, and the cache it holds."""

from __future__ import annotations

from relaytrain.cost.formulas import ModelFacts, StepCost
from relaytrain.cost.profile import Profile
from relaytrain.cost.rollout import SamplingCost, kv_cache_bytes, placement, sampling_cost, weight_bytes
from relaytrain.run.resolve import choose

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
                         scoring_passes=int(goal.num_iterations > 1) + int(goal.beta != 0), where=where)


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
