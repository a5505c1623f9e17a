"""Experts streamed by need under L2L (`strategy.experts_by_need=true`): a block's frozen experts
cross only where the router picked them, and the run is the one that uploads them all, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.models.quantize import bitsandbytes
from relaytrain.models.quantize_experts import ExpertsLayout
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.strategies.experts_by_need import ExpertSlices
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import tiny_moe
from tests.models.test_lora import RUN_KEYS
from tests.models.test_moe import expert_adapter

# 16 experts, one picked a token, and few tokens a step: a step picks at most 8 of a layer's 16.
FEW_PICKS = ["data.seq_len=4", "strategy.microbatch_size=1", "strategy.num_microbatches=2"]
SPARSE = {"num_experts": 16, "num_experts_per_tok": 1}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Qwen3-MoE of 16 experts, a peft adapter on its attention and its experts)."""
    root = tmp_path_factory.mktemp("by_need")
    base = tiny_moe(root / "base", "qwen3_moe", **SPARSE)
    return base, expert_adapter(base, root / "adapter")


def train(base: Path, adapter: Path | None, directory: Path, *overrides: str) -> dict:
    keys = [f"model.pretrained={base}", *RUN_KEYS, "strategy=l2l", *FEW_PICKS, *overrides]
    if adapter is not None:
        keys.append(f"adapter.pretrained={adapter}")
    return run(compose_config(keys), directory, table=False)


def saved_adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model" / "adapter_model.safetensors")


def assert_same_run(streamed: dict, whole: dict, streamed_dir: Path, whole_dir: Path) -> None:
    assert streamed["loss"] == whole["loss"]
    assert streamed["loss_terms"] == whole["loss_terms"]
    ours, theirs = saved_adapter(streamed_dir), saved_adapter(whole_dir)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


EVALUATED = ["data.eval_fraction=0.25", "eval.every=1", "eval.max_batches=2"]


@pytest.mark.parametrize(("continued", "keys"), [
    pytest.param(True, [], id="LoRA on the experts"),
    pytest.param(True, ["model.quantize=nf4"], id="LoRA on 4-bit experts"),
    pytest.param(False, ["adapter.target_modules=[q_proj,v_proj]", *EVALUATED], id="frozen experts, evaluated"),
])
def test_streamed_by_need_trains_what_uploading_every_expert_trains(continued, keys, mixture, tmp_path):
    """LoRA on attention and on the experts (their base frozen), dense or in NF4, or on attention
    alone: the same losses, balancing term, evaluations and adapters bit for bit, with fewer bytes
    over the link."""
    base, adapter = mixture
    adapter = adapter if continued else None
    streamed = train(base, adapter, tmp_path / "streamed", *keys, "strategy.experts_by_need=true")
    whole = train(base, adapter, tmp_path / "whole", *keys)
    assert_same_run(streamed, whole, tmp_path / "streamed", tmp_path / "whole")
    assert streamed["eval"] == whole["eval"]

    by_need = streamed["strategy_report"]["experts_by_need"]
    assert 0 < by_need["uploaded_bytes"] < 0.6 * by_need["whole_bytes"]
    assert by_need["recompute_misses"] == 0  # the backward's experts arrived with its part, prefetched
    assert streamed["strategy_report"]["uploaded_bytes"] < whole["strategy_report"]["uploaded_bytes"]
    saved = whole["strategy_report"]["uploaded_bytes"] - streamed["strategy_report"]["uploaded_bytes"]
    assert saved == by_need["whole_bytes"] - by_need["uploaded_bytes"]  # every saved byte is an expert's
    assert "experts uploaded by need" in streamed["strategy_report"]["summary"]


@pytest.mark.slow  # two more runs; the cast path is the GPU test's too
def test_a_half_precision_base_is_cast_into_place_as_the_whole_upload_casts_it(tmp_path):
    """A bf16 checkpoint's frozen experts stay bf16 on the host; the picked experts' rows are cast
    to the relay's fp32 as they land, as a whole upload casts the tensor."""
    base = tiny_moe(tmp_path / "base", "qwen3_moe", dtype=torch.bfloat16, **SPARSE)
    streamed = train(base, None, tmp_path / "streamed", "adapter=lora", "strategy.experts_by_need=true")
    whole = train(base, None, tmp_path / "whole", "adapter=lora")
    assert_same_run(streamed, whole, tmp_path / "streamed", tmp_path / "whole")
    assert streamed["strategy_report"]["experts_by_need"]["uploaded_bytes"] > 0


@pytest.mark.slow  # GPT-OSS: experts stored (in, out), with per-expert biases that stream too
def test_gpt_oss_experts_and_their_biases_stream_by_need(tmp_path):
    base = tiny_moe(tmp_path / "base", "gpt_oss", num_local_experts=16, num_experts_per_tok=1)
    adapter = expert_adapter(base, tmp_path / "adapter")
    streamed = train(base, adapter, tmp_path / "streamed", "strategy.experts_by_need=true")
    whole = train(base, adapter, tmp_path / "whole")
    assert_same_run(streamed, whole, tmp_path / "streamed", tmp_path / "whole")
    by_need = streamed["strategy_report"]["experts_by_need"]
    assert by_need["uploaded_bytes"] < 0.6 * by_need["whole_bytes"]


@pytest.mark.slow  # four processes
def test_replicas_each_stream_the_experts_their_rows_picked(mixture, tmp_path):
    base, adapter = mixture
    keys = ["strategy.replicas=2", "strategy.microbatch_size=2"]
    streamed = train(base, adapter, tmp_path / "streamed", *keys, "strategy.experts_by_need=true")
    whole = train(base, adapter, tmp_path / "whole", *keys)
    assert_same_run(streamed, whole, tmp_path / "streamed", tmp_path / "whole")
    by_need = streamed["strategy_report"]["experts_by_need"]  # worker 0's
    assert by_need["uploaded_bytes"] < by_need["whole_bytes"] and by_need["recompute_misses"] == 0


def test_a_dry_run_uploads_every_expert(mixture, tmp_path):
    """On the meta device there are no picks to read: the relay moves every expert, and the
    device figures are the same (a streamed tensor is whole on the device)."""
    base, adapter = mixture
    results = train(base, adapter, tmp_path / "dry", "train.device=meta", "train.save_model=false",
                    "strategy.experts_by_need=true")
    assert "experts_by_need" not in results["strategy_report"]


def test_the_pieces_of_chosen_experts_read_as_those_experts_in_4_bits():
    """An NF4 storage holding only experts 1 and 3 (and the shared second-level scales) dequantizes
    to the whole storage's values in those experts' rows."""
    bitsandbytes()
    weight = torch.randn(4, 8, 64)
    for double in (False, True):
        layout = ExpertsLayout.of(weight, double)
        storage = layout.pack(weight)
        partial = torch.zeros_like(storage)
        slices = ExpertSlices.nf4(layout)
        for start, stop in [*slices.shared, *slices.spans([1, 3])]:
            partial[start:stop] = storage[start:stop]
        whole, some = layout.dequantize(storage, torch.float32), layout.dequantize(partial, torch.float32)
        assert torch.equal(some[[1, 3]], whole[[1, 3]])
        assert not torch.equal(some[0], whole[0])


def test_consecutive_experts_cross_as_one_span():
    slices = ExpertSlices(experts=8, strided=((0, 10), (100, 2)))
    assert slices.spans([1, 2, 3, 6]) == [(10, 40), (102, 108), (60, 70), (112, 114)]


def test_a_full_fine_tune_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="full fine-tune trains them"):
        from relaytrain.strategies.l2l import L2L

        L2L.check_config(compose_config(["model=qwen3_30b_a3b", "strategy=l2l", "strategy.experts_by_need=true"]))


def test_a_model_without_frozen_experts_is_refused_in_one_line(tmp_path):
    """A dense model under LoRA has no experts to stream."""
    from tests.checkpoints import tiny_decoder

    base = tiny_decoder(tmp_path / "dense", "llama")
    with pytest.raises(ConfigError, match="no frozen expert weights to stream"):
        train(base, None, tmp_path / "run", "adapter=lora", "strategy.experts_by_need=true")
