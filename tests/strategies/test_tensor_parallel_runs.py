"""Tensor parallelism through the real trainer: `strategy.tensor_parallel=2` under the whole-model
strategy's placements, on real gloo process groups.

Two workers split every block of a tiny Llama (and Qwen3, its per-head norms replicated) and train,
with keyed dropout on, AdamW with weight decay and a warm-up, and global-norm clipping on (the
norm over split and whole gradients together), to the plain loop's weights; so do 2 replicas x 2
tensor parts under FSDP (a 2-D mesh) and under the baseline (the replicas summing their parts'
gradients). A T=2 checkpoint holds whole tensors by name: it resumes at T=1 and under l2l, and a
T=1 checkpoint at T=2, to the uninterrupted run's weights. The dry run counts a tensor rank's
share of the trained state, and what does not compose is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from relaytrain.commands.cli import main
from relaytrain.models import build_model
from relaytrain.planner.dryrun import simulate
from relaytrain.records import checkpoint
from relaytrain.run.train import run
from relaytrain.strategies import strategy_class
from relaytrain.utils.errors import ConfigError
from tests.conftest import TINY_LLAMA, tiny_cfg, train_plain_loop

STEPS = 3
TOLERANCE = {"atol": 2e-6, "rtol": 1e-5}  # fp32: the row-wise layers and the norm add their parts in another order


# A tiny decoder (4 heads, 2 key/value heads), dropout on, AdamW with weight decay and a warm-up,
# clipping at a norm below the gradients' (every step clipped), two micro-batches of 2 rows a step.
RUN = ("model.dropout=0.1", f"train.steps={STEPS}", "train.save_model=true", "optim=adamw", "optim.lr=0.01",
       "optim.weight_decay=0.1", "optim.warmup_steps=2", "optim.eps=1e-4", "optim.grad_clip=0.05",
       "strategy.microbatch_size=2", "strategy.num_microbatches=2")


def tp_cfg(*overrides: str, strategy: str = "baseline", model_type: str = "llama"):
    """`RUN` split in 2 (2 rows a micro-batch per replica)."""
    return tiny_cfg("llama", f"model.model_type={model_type}", f"strategy={strategy}", *RUN,
                    "strategy.tensor_parallel=2", "strategy.timeout_s=60", *overrides)


def unsplit(cfg):
    """The same run at T=1 under the baseline in one process over the whole minibatch (its
    micro-batches R times larger)."""
    single = copy.deepcopy(cfg)
    replicas = cfg.strategy.replicas
    for key, value in (("name", "baseline"), ("tensor_parallel", 1), ("replicas", 1),
                       ("microbatch_size", cfg.strategy.microbatch_size * replicas)):
        OmegaConf.update(single, f"strategy.{key}", value)
    return single


def saved_model(cfg, run_dir) -> nn.Module:
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(run_dir / "model"))
    return build_model(saved.model).hf_model


def plain_loop(cfg) -> nn.Module:
    """The reference: the plain loop over the whole minibatch, each replica's rows keyed as its own."""
    return train_plain_loop(unsplit(cfg), STEPS, replicas=cfg.strategy.replicas).hf_model


def assert_same(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda why, n=name: f"{what} {n}: {why}")


# --------------------------------------------------------------------------- training to the plain loop's weights


def test_two_tensor_parts_train_a_tiny_llama_to_the_plain_loops_weights(tmp_path):
    cfg = tp_cfg()
    results = run(cfg, tmp_path / "split", table=False)
    assert_same(saved_model(cfg, tmp_path / "split"), plain_loop(cfg), "T=2:")
    assert results["processes"] == 2 and results["replicas"] == 1
    assert results["strategy_report"]["summary"]["tensor parallel"] == "every block split over 2 workers"


@pytest.mark.slow  # two workers, ~10 s
def test_two_tensor_parts_train_a_tiny_qwen3_with_recompute_and_evaluation(tmp_path):
    cfg = tp_cfg("strategy.recompute=block", "data.eval_fraction=0.25", model_type="qwen3")
    results = run(cfg, tmp_path / "split", table=False)
    assert_same(saved_model(cfg, tmp_path / "split"), plain_loop(cfg), "T=2:")
    single = run(unsplit(cfg), tmp_path / "single", table=False)  # each tensor part saw every row: counted once
    assert results["eval"][-1]["items"] == single["eval"][-1]["items"]
    assert results["eval"][-1]["loss"] == pytest.approx(single["eval"][-1]["loss"], rel=1e-5)


@pytest.mark.slow  # four workers, ~20 s each
@pytest.mark.parametrize("strategy", ["fsdp", "baseline"])
def test_two_replicas_of_two_tensor_parts_train_to_the_plain_loops_weights(strategy, tmp_path):
    """FSDP shards over the shard dim of a 2-D mesh, the split blocks over both dims; the
    baseline's replicas sum their parts' gradients over the replicate dim."""
    cfg = tp_cfg("strategy.replicas=2", strategy=strategy)
    results = run(cfg, tmp_path / "split", table=False)
    assert_same(saved_model(cfg, tmp_path / "split"), plain_loop(cfg), f"{strategy} R=2 x T=2:")
    assert results["processes"] == 4 and results["replicas"] == 2 and results["samples_per_step"] == 8


def test_the_fp16_overflow_check_skips_the_step_on_every_tensor_part(tmp_path):
    """A scale that overflows in the first step's gradients: every worker skips it (none updates its parts)."""
    cfg = tp_cfg("precision=amp_fp16", "precision.loss_scale=1e38", "train.steps=1")
    results = run(cfg, tmp_path / "split", table=False)
    initial = build_model(cfg.model, seed=cfg.train.seed).hf_model
    for (name, a), (_, b) in zip(saved_model(cfg, tmp_path / "split").named_parameters(), initial.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert results["skipped_steps"] == 1


# --------------------------------------------------------------------------- checkpoints by name, at any T


@pytest.mark.slow  # four runs, ~30 s
def test_a_split_checkpoint_resumes_at_one_worker_and_under_l2l_and_back(tmp_path):
    keys = ("train.checkpoint_every=1", "train.keep_checkpoints=0")
    cfg = tp_cfg(*keys)
    run(cfg, tmp_path / "split", table=False)
    final = saved_model(cfg, tmp_path / "split")
    step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "split"), 1)
    resumed = {"baseline": unsplit(tp_cfg(*keys, f"train.resume={step_one}")),  # T=2 -> T=1
               "l2l": tiny_cfg("llama", "strategy=l2l", *RUN, *keys, f"train.resume={step_one}")}
    for name, again in resumed.items():
        run(again, tmp_path / name, table=False)
        assert_same(saved_model(cfg, tmp_path / name), final, f"T=2 -> {name}:")
    run(unsplit(cfg), tmp_path / "whole", table=False)  # T=1 -> T=2
    whole_step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "whole"), 1)
    run(tp_cfg(*keys, f"train.resume={whole_step_one}"), tmp_path / "resplit", table=False)
    assert_same(saved_model(cfg, tmp_path / "resplit"), final, "T=1 -> T=2:")


@pytest.mark.slow  # three runs of four workers and two of one, ~50 s
def test_a_checkpoint_of_two_replicas_of_two_tensor_parts_under_fsdp_resumes_anywhere(tmp_path):
    """Its DCP directory (each split weight sharded over both mesh dims) resumes exactly as it was
    saved, as whole tensors at T=1, and a T=1 checkpoint resumes into it. Dropout off: a run of one
    replica draws other masks than two replicas do."""
    keys = ("train.checkpoint_every=1", "train.keep_checkpoints=0", "strategy.replicas=2", "model.dropout=0")
    cfg = tp_cfg(*keys, strategy="fsdp")
    run(cfg, tmp_path / "split", table=False)
    final = saved_model(cfg, tmp_path / "split")
    step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "split"), 1)
    run(tp_cfg(*keys, f"train.resume={step_one}", strategy="fsdp"), tmp_path / "again", table=False)
    for (name, a), (_, b) in zip(saved_model(cfg, tmp_path / "again").named_parameters(), final.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    run(unsplit(tp_cfg(*keys, f"train.resume={step_one}", strategy="fsdp")), tmp_path / "unsplit", table=False)
    assert_same(saved_model(cfg, tmp_path / "unsplit"), final, "R=2 x T=2 -> T=1:")
    run(unsplit(cfg), tmp_path / "whole", table=False)
    whole_step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "whole"), 1)
    run(tp_cfg(*keys, f"train.resume={whole_step_one}", strategy="fsdp"), tmp_path / "resplit", table=False)
    assert_same(saved_model(cfg, tmp_path / "resplit"), final, "T=1 -> R=2 x T=2:")


# --------------------------------------------------------------------------- the dry run


def _linear_weights(model) -> int:
    """What the split cuts: every block's linear layers (a Llama's have no bias)."""
    return sum(m.weight.numel() for block in model.blocks for m in block.modules() if isinstance(m, nn.Linear))


def test_the_dry_run_holds_a_tensor_ranks_share_of_the_trained_state():
    dry = ["strategy.microbatch_size=2", "strategy.num_microbatches=1", "train.device=meta"]
    whole, split = (simulate(tiny_cfg("llama", "strategy=baseline", f"strategy.tensor_parallel={size}", *dry))
                    for size in (1, 2))
    model = build_model(tiny_cfg("llama").model)
    total = sum(p.numel() for p in model.parameters())
    kept = (total - _linear_weights(model) / 2) / total
    assert len(split.per_process) == 2
    for kind in ("weights", "gradients", "optimizer state"):
        assert split.per_process[0].by_kind[kind] == pytest.approx(whole.per_process[0].by_kind[kind] * kept, abs=1)
    assert split.peak_bytes < whole.peak_bytes


# --------------------------------------------------------------------------- what does not compose


@pytest.mark.parametrize(("strategy", "overrides", "refusal"), [
    ("baseline", ["strategy.sequence_parallel=2"], "both split attention's heads over workers"),
    ("baseline", ["train.compile=true"], "strategy.tensor_parallel with train.compile=true is not supported yet"),
    ("fsdp", ["strategy.replicas=1"], "has no dim to shard over; use strategy=baseline strategy.tensor_parallel=2"),
    ("fsdp", ["strategy.replicas=2", "strategy.offload=host"], "strategy.offload=host with strategy.tensor_parallel"),
    ("baseline", ["strategy.tensor_parallel=0"], "strategy.tensor_parallel=0 must be at least 1"),
])
def test_what_does_not_compose_is_refused_in_one_line(strategy, overrides, refusal):
    cfg = tp_cfg(*overrides, strategy=strategy)
    with pytest.raises(ConfigError, match=refusal) as refused:
        strategy_class(strategy).check_config(cfg)
    assert "\n" not in str(refused.value)


def test_a_strategy_without_the_key_refuses_it_in_one_line(capsys):
    try:
        code = main(["train", *TINY_LLAMA, "strategy=l2l", "strategy.tensor_parallel=2"])
    except SystemExit as stop:
        code = stop.code
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "strategy.tensor_parallel is not a key of strategy=l2l; only strategy=baseline/fsdp have it" in line
