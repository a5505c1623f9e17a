"""strategy.layout=balanced: pipeline stages cut by each part's analytic cost, the ends counted."""

import itertools

import pytest
import torch

from relaytrain.commands.cli import main
from relaytrain.cost.formulas import ModelFacts, part_costs
from relaytrain.run.compose import compose_config
from relaytrain.strategies import strategy_class
from relaytrain.strategies.pipeline.stage import balanced_layout, partition
from tests.conftest import train_plain_loop
from tests.strategies.pipeline.test_runtime import (
    STEPS,
    assert_same_weights,
    pipeline_cfg,
    trained_by_pipeline,
    whole_minibatch_cfg,
)


def stage_costs(blocks, counts, first, last):
    starts = list(itertools.accumulate([0, *counts]))
    costs = [sum(blocks[a:b]) for a, b in itertools.pairwise(starts)]
    costs[0] += first
    costs[-1] += last
    return costs


def best_max_by_search(blocks, parts, first, last):
    """Every cut into `parts` parts of at least one block: the smallest costliest part."""
    n = len(blocks)
    return min(max(stage_costs(blocks, [b - a for a, b in itertools.pairwise((0, *cuts, n))], first, last))
               for cuts in itertools.combinations(range(1, n), parts - 1))


@pytest.mark.parametrize(
    ("blocks", "parts", "first", "last"),
    [
        ([1.0] * 8, 2, 0.3, 5.5),
        ([1.0] * 10, 4, 0.0, 0.0),
        ([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], 3, 2.0, 7.0),
        ([2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0], 4, 10.0, 0.5),
        ([1.0] * 5, 5, 0.0, 100.0),
    ],
)
def test_the_partitioner_minimises_the_costliest_stage(blocks, parts, first, last):
    counts = balanced_layout(blocks, parts, first, last)
    assert len(counts) == parts and sum(counts) == len(blocks) and min(counts) >= 1
    assert max(stage_costs(blocks, counts, first, last)) == pytest.approx(best_max_by_search(blocks, parts, first, last))
    assert balanced_layout(list(blocks), parts, first, last) == counts  # deterministic


def test_the_ends_are_pinned_to_the_first_and_last_stage():
    # A costly head leaves the last stage one block; costly embeddings, the first.
    assert balanced_layout([1.0] * 8, 2, 0.0, 6.0) == [7, 1]
    assert balanced_layout([1.0] * 8, 2, 6.0, 0.0) == [1, 7]
    assert balanced_layout([1.0] * 6, 3, 0.0, 100.0) == [3, 2, 1]  # every stage keeps a block
    # Free ends and equal blocks: the even split, leftovers to the first stages.
    for n, parts in [(5, 2), (7, 3), (10, 4), (8, 8)]:
        assert balanced_layout([1.0] * n, parts) == [len(r) for r in partition(n, parts)]
    with pytest.raises(ValueError):
        balanced_layout([1.0] * 2, 3)


def layouts(overrides):
    cfg = compose_config(overrides)
    cls = strategy_class(cfg.strategy.name)
    cls.check_config(cfg)
    return cls.state_layout(cfg)["stages"]


GPT2_BIG_VOCAB = ["model=gpt2_tiny", "model.num_layers=8", "strategy.stages=2"]  # vocabulary 8192 x hidden 128


@pytest.mark.parametrize("strategy", ["pipe_flush", "pipe_2bw", "pipe_gpipe"])
def test_a_big_vocabulary_leaves_the_last_stage_fewer_blocks(strategy):
    even = layouts([*GPT2_BIG_VOCAB, f"strategy={strategy}", "strategy.layout=even"])
    balanced = layouts([*GPT2_BIG_VOCAB, f"strategy={strategy}"])  # the default
    assert even == [4, 4] == [len(r) for r in partition(8, 2)]  # even: today's split
    assert balanced[-1] < even[-1] and sum(balanced) == 8
    assert layouts([*GPT2_BIG_VOCAB, f"strategy={strategy}", "strategy.layout=balanced"]) == balanced
    assert layouts([*GPT2_BIG_VOCAB, f"strategy={strategy}", "strategy.layout=[5,3]"]) == [5, 3]


def test_interleaving_balances_the_model_chunks():
    chunks = layouts([*GPT2_BIG_VOCAB, "strategy=pipe_interleaved", "strategy.chunks=2", "strategy.num_microbatches=4"])
    assert len(chunks) == 4 and sum(chunks) == 8 and chunks[-1] == min(chunks)


def test_the_cost_counts_the_head_and_the_embeddings_gradient():
    cfg = compose_config(GPT2_BIG_VOCAB + ["strategy=pipe_flush"])
    costs = part_costs(ModelFacts.of(cfg), 8)
    assert costs.head > 3 * costs.block  # 8192 x 128 vocabulary matmul against a 128-wide block
    assert 0 < costs.embed < costs.block
    assert part_costs(ModelFacts.of(cfg), 8, "block").block > costs.block


@pytest.mark.parametrize("layout", ["balance", "[4,3]", "[0,8]", "[true,7]"])
def test_a_bad_layout_is_refused_in_one_line(layout, capsys):
    assert main(["train", *GPT2_BIG_VOCAB, "strategy=pipe_flush", f"strategy.layout={layout}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be balanced, even or 2 positive block counts" in err[0]


def test_a_balanced_flush_trains_as_the_plain_loop(tmp_path):
    # 4 blocks of width 32 before a 4096-word head: balanced gives [3, 1] where even gives [2, 2].
    cfg = pipeline_cfg("gpt2", "model.num_layers=4", "model.vocab_size=4096", "strategy=pipe_flush",
                       "strategy.stages=2", "strategy.microbatch_size=2", "strategy.num_microbatches=3",
                       "optim=sgd", "optim.lr=0.05")
    assert str(cfg.strategy.layout) == "balanced"
    results, ours = trained_by_pipeline(cfg, tmp_path)
    assert results["strategy_report"]["layout"] == [3, 1]
    assert_same_weights(ours, train_plain_loop(whole_minibatch_cfg(cfg), STEPS).hf_model)
    assert torch.equal(ours.transformer.wte.weight, ours.lm_head.weight)
