"""What tensor parallelism (`strategy.tensor_parallel=T`) costs in the whole-model cost models,
against a hand count: a tensor rank holds 1/T of every block's matrices (weights, gradients,
optimizer state) and of the activations inside attention and the MLP, the ends whole; it
computes 1/T of every block; it all-reduces a block's activations twice each way per block and
micro-batch over its T ranks; and its gradients are summed (FSDP: sharded) over the R workers
that hold the same share, not over all R x T."""

from __future__ import annotations

import pytest

from relaytrain.cost.formulas import FP32, ModelFacts
from relaytrain.cost.profile import PartTimes, Profile, Timings
from relaytrain.cost.shape import Shape
from relaytrain.planner.candidates import GiB, candidate_config
from relaytrain.run.compose import compose_config
from relaytrain.strategies import strategy_class
from tests.conftest import TINY_LLAMA

# TINY_LLAMA by hand: hidden 32, 4 query heads of 8 (q = 32), 2 key/value heads (kv = 16), a gated
# MLP 64 wide, 3 blocks, 16 tokens a sequence, fp32, AdamW (2 state words).
H, Q, KV, MLP, HEADS, LAYERS, TOKENS = 32, 32, 16, 64, 4, 3, 16
MATRICES = H * Q + 2 * H * KV + Q * H + 3 * H * MLP  # q, k, v, o and gate, up, down: 9,216 weights
SPLIT_VALUES = Q + 2 * KV + Q + 4 * MLP + HEADS  # a token's activations inside attention and the MLP (sdpa)
STATE_BYTES = FP32 * (1 + 1 + 2)  # a trained weight, its gradient and AdamW's two moments


def profile(device_type: str = "cuda", bandwidth: float = 1e9, inter_node: float = 1e9, per_node: int = 8,
            latency: float = 1e-5) -> Profile:
    """A block forward of 10 ms and backward of 20 ms at b=1; ends and optimizer free."""
    zero = PartTimes(0.0, 0.0)
    timings = Timings({1: PartTimes(0.01, 0.02)}, {1: zero}, {1: zero}, 0.0, 0.0)
    return Profile("synthetic", "test device", device_type, "synthetic", 8, 16 * GiB,
                   None if device_type == "cpu" else 1e10, bandwidth, bandwidth, inter_node, per_node, latency, 0.0,
                   {1 if device_type == "cpu" else 0: timings})  # a CPU's: one thread a worker


def priced(shape: Shape, prof: Profile | None = None):
    """`shape`'s predicted step (on `prof`) and closed-form device bytes, and its config."""
    cfg = candidate_config(compose_config([*TINY_LLAMA, "train.threads=1", f"strategy={shape.strategy}"]), shape)
    model, facts = strategy_class(shape.strategy).cost_model, ModelFacts.of(cfg)
    return model.step_cost(cfg, facts, prof or profile()), model.device_bytes(cfg, facts), cfg


def test_a_tensor_rank_holds_a_share_of_every_blocks_matrices_and_the_ends_whole():
    facts = ModelFacts.of(compose_config(TINY_LLAMA))
    for size in (2, 4):
        rank = facts.split(size)
        assert facts.block_params - rank.block_params == MATRICES - MATRICES // size
        assert (rank.embed_params, rank.head_params) == (facts.embed_params, facts.head_params)
        assert rank.boundary_bytes(2) == facts.boundary_bytes(2)  # a block's input and output stay whole
    rank = facts.split(2)
    assert rank.split(2) is rank  # a rank's facts asked again for the same T (every cost model places them)
    with pytest.raises(ValueError):
        facts.split(2).split(4)


def test_the_baselines_device_bytes_at_two_tensor_ranks_are_the_hand_count():
    """Half the blocks' matrices with their gradients and AdamW state, half the activations inside
    attention and the MLP: exactly that much less than one worker holding the whole model."""
    for b in (1, 4):
        _, whole, _ = priced(Shape("baseline", b, 1))
        _, split, cfg = priced(Shape("baseline", b, 1, tensor_parallel=2))
        assert strategy_class("baseline").processes(cfg) == 2
        saved = LAYERS * (MATRICES // 2 * STATE_BYTES + b * TOKENS * SPLIT_VALUES // 2 * FP32)
        assert whole - split == saved


def test_fsdp_shards_a_tensor_ranks_share_over_the_replicas_alone():
    """R=2 x T=2: 1/2 of the split blocks' state on each worker, and the two gathered blocks
    split as well; its shards are the replicas' (2), not every worker's (4)."""
    _, whole, _ = priced(Shape("fsdp", 1, 1, 2))
    _, split, cfg = priced(Shape("fsdp", 1, 1, 2, tensor_parallel=2))
    assert strategy_class("fsdp").processes(cfg) == 4
    gathered = 2 * MATRICES // 2 * FP32  # the block computing and the one prefetched, fp32 weights
    saved = LAYERS * MATRICES // 2 * STATE_BYTES // 2 + gathered + LAYERS * TOKENS * SPLIT_VALUES // 2 * FP32
    assert whole - split == saved


@pytest.mark.parametrize("strategy", ["baseline", "fsdp"])
def test_a_tensor_ranks_step_is_half_the_compute_plus_two_all_reduces_a_block_each_way(strategy):
    """Per micro-batch and block, two all-reduces forward and two backward of the block's
    activations (b x tokens x hidden fp32 values), each a ring over T=2 at the profile's rate
    with two hops of latency; a third pair where the block is recomputed."""
    replicas = 2 if strategy == "fsdp" else 1
    whole, _, _ = priced(Shape(strategy, 1, 2, replicas))
    split, _, _ = priced(Shape(strategy, 1, 2, replicas, tensor_parallel=2))
    assert split.parts["compute"] == pytest.approx(whole.parts["compute"] / 2)
    one = (2 - 1) / 2 * 2 * (1 * TOKENS * H * FP32) / 1e9 + 2 * (2 - 1) * 1e-5
    microbatches, passes = 2, 2
    assert split.parts["tensor all-reduces"] == pytest.approx(microbatches * LAYERS * passes * 2 * one)
    assert "tensor all-reduces" not in whole.parts
    recomputing, _, _ = priced(Shape(strategy, 1, 2, replicas, 1, "block", tensor_parallel=2))
    assert recomputing.parts["tensor all-reduces"] == pytest.approx(1.5 * split.parts["tensor all-reduces"])


def test_the_gradient_sums_run_over_the_replicas_on_a_tensor_ranks_share():
    """R=2 x T=2 on a CPU (every sum exposed): one all-reduce over the 2 replicas of a rank's
    gradients (the ends whole, half of every block's matrices), not over all 4 workers; one
    replica of two tensor ranks sums nothing."""
    facts = ModelFacts.of(compose_config(TINY_LLAMA))
    cpu = profile("cpu")
    split, _, _ = priced(Shape("baseline", 1, 2, 2, tensor_parallel=2), cpu)
    nbytes = (facts.params - LAYERS * MATRICES // 2) * FP32
    assert split.parts["gradient sums (exposed)"] == pytest.approx((2 - 1) / 2 * 2 * nbytes / 1e9 + 2 * 1e-5)
    one_replica, _, _ = priced(Shape("baseline", 1, 2, tensor_parallel=2), cpu)
    assert "gradient sums (exposed)" not in one_replica.parts


def test_a_replicas_ring_that_spans_nodes_runs_at_the_links_between_them():
    """Two replicas of two tensor ranks on nodes of two devices: the replicas' gradient ring
    crosses nodes (every other worker) though it has only two members; the tensor ranks' own
    all-reduces stay in a node."""
    fast, slow = profile("cpu", inter_node=1e9), profile("cpu", inter_node=1e8, per_node=2)
    same, _, _ = priced(Shape("baseline", 1, 2, 2, tensor_parallel=2), fast)
    spread, _, _ = priced(Shape("baseline", 1, 2, 2, tensor_parallel=2), slow)
    latency = 2 * 1e-5
    assert spread.parts["gradient sums (exposed)"] - latency == pytest.approx(
        10 * (same.parts["gradient sums (exposed)"] - latency))
    assert spread.parts["tensor all-reduces"] == pytest.approx(same.parts["tensor all-reduces"])
