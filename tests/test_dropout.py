"""Dropout on, every strategy the same run: each part's random draws are keyed by (train.seed,
step, micro-batch index, replica, part), set where the part runs (`models.layered.keyed_draws`).

Through the trainer, with `model.dropout=0.1` and several micro-batches: the baseline equals
the plain loop (and dropout changes its weights), message-driven execution equals static's, and
a baseline checkpoint resumed under L2L continues the same run. Every strategy ending with the
plain loop's weights (2BW with the delayed rule's) with dropout on, and resuming bit for bit, is
the conformance matrix's (tests/conformance/: BERT's cells and the `dropout` feature's). Directly
on the parts: a recompute draws the first forward's masks, two replicas and two
pipeline stages draw different ones, a stage draws what the whole model draws for its blocks,
and the keyed draws leave torch's global stream where it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.checkpoint import checkpoint

from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.models.layered import HEAD_PART, Draw, MicroBatch, block_part, draw_seed
from relaytrain.objectives.base import Divisor
from relaytrain.records import checkpoint as checkpoints
from relaytrain.run.train import run
from relaytrain.strategies import build_strategy
from relaytrain.strategies.base import replica_rows
from relaytrain.strategies.pipeline.stage import StageModule
from relaytrain.utils.errors import ConfigError
from tests.conftest import tiny_cfg, train_plain_loop

STEPS = 3


def dropout_cfg(family: str, *overrides: str):
    """Four blocks, four micro-batches of 2, dropout 0.1, SGD: what every strategy's defaults fit."""
    return tiny_cfg(family, "model.dropout=0.1", "model.num_layers=4", f"train.steps={STEPS}", "train.save_model=true",
                    "strategy.timeout_s=60", "optim=sgd", "optim.lr=0.05", *overrides)


def strategy_cfg(family: str, name: str, *overrides: str):
    return dropout_cfg(family, f"strategy={name}", "strategy.replicas=1", "strategy.microbatch_size=2",
                       "strategy.num_microbatches=4", *overrides)


def trained(cfg, run_dir) -> tuple[dict, nn.Module]:
    """Run `cfg` through the trainer; its results and the model it saved, loaded back."""
    results = run(cfg, run_dir)
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(run_dir / "model"))
    return results, build_model(saved.model).hf_model


def assert_same_weights(a: nn.Module, b: nn.Module, atol: float = 2e-5) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=1e-4, msg=name)


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max(float((pa - pb).detach().abs().max()) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture(scope="module")
def baseline_weights(tmp_path_factory):
    """The baseline's trained weights per family (each trained once for the module)."""
    trained_by = {}

    def weights(family: str) -> nn.Module:
        if family not in trained_by:
            cfg = strategy_cfg(family, "baseline")
            trained_by[family] = trained(cfg, tmp_path_factory.mktemp(f"baseline-{family}"))[1]
        return trained_by[family]

    return weights


# ------------------------------------------------------------------ whole runs through the trainer


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_the_baseline_equals_the_plain_loop_and_dropout_changes_the_weights(family, baseline_weights):
    ours = baseline_weights(family)
    plain = train_plain_loop(strategy_cfg(family, "baseline"), STEPS).hf_model
    assert_same_weights(ours, plain)
    without = train_plain_loop(strategy_cfg(family, "baseline", "model.dropout=0.0"), STEPS).hf_model
    assert max_difference(ours, without) > 1e-3, "dropout changed nothing: the other tests would prove nothing"


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_message_driven_execution_equals_static_with_dropout_on(tmp_path, monkeypatch):
    """GPipe with a slow first stage: the last stage runs backwards out of the program's order,
    and draws the masks static execution draws."""
    cfg = strategy_cfg("gpt2", "pipe_gpipe")
    _, static = trained(cfg, tmp_path / "static")
    monkeypatch.setenv("RELAYTRAIN_STAGE_JITTER", "stage=0,max=1.0,seed=3")
    results, driven = trained(strategy_cfg("gpt2", "pipe_gpipe", "strategy.execution=message_driven"),
                              tmp_path / "driven")
    assert results["strategy_report"]["per_stage"][-1]["out_of_order"] > 0, "nothing was reordered"
    for (name, a), (_, b) in zip(static.named_parameters(), driven.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_baseline_checkpoint_resumed_under_l2l_continues_the_same_run(baseline_weights, tmp_path):
    """Resuming by name under another strategy: with the masks keyed, the same weights as the
    uninterrupted baseline, dropout on."""
    cfg = strategy_cfg("bert", "baseline", "train.checkpoint_every=1", "train.keep_checkpoints=0")
    run(cfg, tmp_path / "baseline")
    first = checkpoints.step_dir(checkpoints.checkpoint_dir(tmp_path / "baseline"), 1)
    _, resumed = trained(strategy_cfg("bert", "l2l", f"train.resume={first}"), tmp_path / "l2l")
    assert_same_weights(resumed, baseline_weights("bert"))


def test_l2l_refuses_micro_batches_without_a_key_when_dropout_is_on():
    """Its recompute redraws the forward's masks only from the key."""
    cfg = strategy_cfg("bert", "l2l")
    strategy = build_strategy(build_model(cfg.model, cfg.train.seed), cfg)
    try:
        minibatch = next(iter(build_loader(cfg, build_dataset(cfg))))
        unkeyed = [MicroBatch(mb.input_ids, mb.labels, mb.attention_mask) for mb in minibatch]
        with pytest.raises(ValueError, match="keyed micro-batches"):
            strategy.step(unkeyed, 0.01)
    finally:
        strategy.close()


# ------------------------------------------------------------------ the parts, directly


class MaskRecorder:
    """The dropout masks each block's `nn.Dropout` modules draw, per call, in call order."""

    def __init__(self, blocks):
        self.masks: dict[int, list[torch.Tensor]] = {}
        self.handles = [module.register_forward_hook(self._hook(block.index))
                        for block in blocks for module in block.modules() if isinstance(module, nn.Dropout)]

    def _hook(self, index: int):
        def record(module, inputs, output):
            self.masks.setdefault(index, []).append((output != 0).detach().clone())
        return record

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def keyed_batch(family: str = "bert") -> tuple[object, MicroBatch]:
    cfg = dropout_cfg(family, "model.num_layers=4", "strategy.microbatch_size=4")
    model = build_model(cfg.model, cfg.train.seed)
    minibatch = build_loader(cfg, build_dataset(cfg), replicas=1).minibatch(5)
    return model, minibatch[1]


def test_the_key_is_carried_by_to_and_rows_and_set_by_the_loader():
    cfg = dropout_cfg("bert", "train.seed=7", "strategy.num_microbatches=3")
    minibatch = build_loader(cfg, build_dataset(cfg), replicas=2).minibatch(4)
    assert [mb.draw for mb in minibatch] == [Draw(7, 4, k) for k in range(3)]
    assert minibatch[2].to("cpu").draw == Draw(7, 4, 2)
    shares = [replica_rows(minibatch, r, 2)[2] for r in range(2)]
    assert [share.draw for share in shares] == [Draw(7, 4, 2, 0), Draw(7, 4, 2, 1)]
    assert torch.equal(torch.cat([s.input_ids for s in shares]), minibatch[2].input_ids)


def test_draw_seeds_are_distinct_over_the_keys_of_a_run():
    keys = [(Draw(seed, step, index, replica), part) for seed in (0, 1) for step in range(12) for index in range(4)
            for replica in range(3) for part in [*map(block_part, range(5)), 0, HEAD_PART]]
    seeds = {draw_seed(draw, part) for draw, part in keys}
    assert len(seeds) == len(keys) and all(0 <= s < 2**64 for s in seeds)
    with pytest.raises(ConfigError, match="^train.steps: .*lower train.steps$"):
        draw_seed(Draw(0, 2**26, 0), HEAD_PART)
    with pytest.raises(ConfigError, match="^model.num_layers: "):
        block_part(HEAD_PART - 1)  # would be the head's code


def test_a_recompute_draws_the_first_forwards_masks_and_leaves_the_global_stream_alone():
    model, mb = keyed_batch()
    hidden = model.embed_input(mb.input_ids, mb.draw).detach().requires_grad_(True)
    ctx = model.context(mb, hidden)
    block = model.blocks[1]
    recorder = MaskRecorder([block])
    before = torch.get_rng_state()
    out = checkpoint(block, hidden, ctx, use_reentrant=False)  # the baseline's recompute=block
    assert torch.equal(torch.get_rng_state(), before), "a keyed draw moved the global stream"
    torch.rand(100)  # whatever the global stream does in between
    out.sum().backward()  # recomputes the block
    again = block(hidden, ctx)  # L2L's recompute: the same call again
    recorder.close()
    calls = len(recorder.masks[1]) // 3  # the block's dropout modules, per run of the block
    first, recomputed, relayed = (recorder.masks[1][k * calls:(k + 1) * calls] for k in range(3))
    assert calls > 0 and all(m.float().mean() < 0.97 for m in first), "no dropout was drawn"
    for a, b, c in zip(first, recomputed, relayed, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(again, out)


def test_two_replicas_draw_different_masks_for_the_same_rows():
    model, mb = keyed_batch()
    rows = slice(0, 2)
    masks = []
    for replica in (0, 1, 0):
        share = mb.rows(rows, replica)
        recorder = MaskRecorder(model.blocks)
        model(share)
        recorder.close()
        masks.append(recorder.masks[0][0])
    assert torch.equal(masks[0], masks[2]), "the same key drew other masks"
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_pipeline_stages_draw_what_the_whole_model_draws_and_differ_from_each_other(family):
    """Before keyed draws every stage started the same stream: stage 1's first block drew stage
    0's first block's masks."""
    model, mb = keyed_batch(family)
    whole = MaskRecorder(model.blocks)
    model(mb)
    whole.close()
    stages = [StageModule(copy.deepcopy(model), blocks, first=s == 0, last=s == 1)
              for s, blocks in enumerate([range(0, 2), range(2, 4)])]
    staged = MaskRecorder([block for stage in stages for block in stage.model.blocks])
    hidden = stages[0](mb, None, Divisor(1))
    stages[1](mb, hidden, Divisor(1))
    staged.close()
    assert sorted(staged.masks) == [0, 1, 2, 3]
    for index, masks in whole.masks.items():
        for a, b in zip(masks, staged.masks[index], strict=True):
            assert torch.equal(a, b), f"block {index}"
    assert not torch.equal(staged.masks[0][0], staged.masks[2][0]), "both stages' first blocks drew the same masks"
