"""`precision=amp_fp8` / `cmp_fp8`: the blocks' linear layers in FP8 with torchao's float8 recipe.

FP8 products are refused on this CPU machine, as on any device without FP8 tensor cores. torch
has a CPU kernel for them (`torch._scaled_mm`), so with the device check lifted the runs here are
held to torchao's own recipe in a plain loop: the same modules, the same casts, the same sums.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from relaytrain.models import build_model, float8
from relaytrain.run.train import run
from relaytrain.strategies import choices, strategy_class
from relaytrain.utils.errors import ConfigError
from tests.conftest import needs_extra, tiny_cfg, train_plain_loop, with_marks

needs_torchao = with_marks(needs_extra("torchao", "lowbit"))

STEPS = 2
# SGD keeps a gradient's size (Adam's first steps would turn rounding noise in a near-zero
# gradient into a whole lr); llama_tiny's projections are 32 and 64 wide, 16 for the keys and values.
KEYS = ["optim=sgd", f"train.steps={STEPS}", "train.untimed_steps=0", "train.save_model=true",
        "strategy.microbatch_size=2", "strategy.num_microbatches=2"]


@pytest.fixture
def fp8_anywhere(monkeypatch):
    """This machine taken for one with FP8 tensor cores (its CPU multiplies in FP8 too, slowly)."""
    monkeypatch.setattr(float8, "device_refusal", lambda device_type: None)


def trained(tmp_path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    cfg = tiny_cfg("llama", *KEYS, *overrides)
    run(cfg, tmp_path / name, quiet=True)
    saved = copy.deepcopy(cfg)
    saved.model.pretrained = str(tmp_path / name / "model")
    return {n: p.detach().clone() for n, p in build_model(saved.model).named_parameters()}


def torchao_plain_loop(cfg, delay: int = 0) -> dict[str, torch.Tensor]:
    """The reference: relaytrain's plain loop over the model with torchao's
    `convert_to_float8_training` on each block's linear layers (those FP8 products take), every
    micro-batch's loss under bf16 autocast; `delay=1`, PipeDream-2BW's rule."""
    from torchao.float8 import convert_to_float8_training

    def convert(model):
        for block in model.blocks:
            convert_to_float8_training(block, module_filter_fn=lambda m, _: m.in_features % 16 == 0
                                       and m.out_features % 16 == 0)

    model = train_plain_loop(cfg, cfg.train.steps, delay, prepare=convert, autocast=torch.bfloat16)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@needs_torchao
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() >= float8.FP8_CAPABILITY,
                    reason="this machine has FP8 tensor cores")
@pytest.mark.parametrize("keys", [["precision=amp_fp8"], ["precision=cmp_fp8", "strategy=l2l"]])
def test_fp8_is_refused_in_one_line_without_fp8_tensor_cores(tmp_path, keys):
    with pytest.raises(ConfigError, match=r"needs FP8 tensor cores.*use precision=(amp|cmp)_bf16"):
        run(tiny_cfg("llama", *keys), tmp_path / "run", quiet=True)


@pytest.mark.parametrize("keys", [["precision=amp_fp8", "adapter=lora"], ["precision=cmp_fp8", "strategy=baseline"]])
def test_what_fp8_does_not_take_yet_and_cross_precision_off_l2l_are_refused(tmp_path, keys):
    with pytest.raises(ConfigError, match="use .*precision=amp_(bf16|fp8)"):
        run(tiny_cfg("llama", *keys), tmp_path / "run", quiet=True)


@needs_torchao
def test_fp8_rounds_far_more_than_bf16(tmp_path, fp8_anywhere):
    """FP8 did run: away from fp32 its rounding is several times bf16's."""
    fp32 = trained(tmp_path, "fp32")
    bf16 = trained(tmp_path, "bf16", "precision=amp_bf16")
    fp8 = trained(tmp_path, "fp8", "precision=amp_fp8")
    assert largest_difference(fp8, fp32) > 2 * largest_difference(bf16, fp32)


# Every registered strategy, on one replica (several take their FP8 scales each over its own rows,
# as torchao's recipe does under data parallelism) and four blocks (pipe_interleaved's 2 x 2 chunks).
# The single-process ones in the default step; those that start workers in the slow one.
STRATEGIES = [pytest.param(name, marks=() if name in ("baseline", "l2l") else pytest.mark.slow) for name in choices()]


@needs_torchao
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_amp_fp8_under_every_strategy_is_torchaos_recipe_in_a_plain_loop(tmp_path, fp8_anywhere, strategy):
    keys = [f"strategy={strategy}", "model.num_layers=4"]
    cls = strategy_class(strategy)
    if cls.replicas(tiny_cfg("llama", *KEYS, *keys)) > 1:
        keys.append("strategy.replicas=1")
    reference = torchao_plain_loop(tiny_cfg("llama", *KEYS, *keys), delay=cls.capabilities.update_delay)
    assert largest_difference(trained(tmp_path, strategy, "precision=amp_fp8", *keys), reference) <= 1e-6


@needs_torchao
def test_cmp_fp8_under_l2l_trains_within_fp8s_noise_of_the_amp_run(tmp_path, fp8_anywhere, monkeypatch):
    """Cross precision relays bf16 copies of the masters, so it casts bf16 weights to FP8 where
    amp casts fp32 ones; every block's projections are swapped, and it lands within FP8's own
    rounding of the amp run."""
    swapped = []
    swap = float8.float8_blocks
    monkeypatch.setattr(float8, "float8_blocks", lambda model: swapped.append(swap(model)) or swapped[-1])
    fp32 = trained(tmp_path, "fp32")
    amp = trained(tmp_path, "amp", "precision=amp_fp8", "strategy=l2l")
    cmp = trained(tmp_path, "cmp", "precision=cmp_fp8", "strategy=l2l")
    assert swapped == [7 * 3, 7 * 3]  # q, k, v, o, gate, up, down in each of 3 blocks
    assert largest_difference(cmp, amp) <= largest_difference(amp, fp32)


@needs_torchao
@pytest.mark.parametrize("keys", [["precision=amp_fp8"], ["precision=cmp_fp8", "strategy=l2l"]])
def test_an_fp8_run_resumes_exactly(tmp_path, fp8_anywhere, keys):
    """The scales are taken afresh each call: a checkpoint holds the weights alone, and the run
    resumed from step one ends on the uninterrupted run's weights bit for bit."""
    from tests.conformance.references import assert_resumes_exactly

    assert_resumes_exactly(lambda *more: tiny_cfg("llama", *KEYS, "train.steps=3", *keys, *more), [], tmp_path)


def test_without_torchao_fp8_is_refused_with_the_install_that_mends_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as where the lowbit extra is not installed
    with pytest.raises(ConfigError, match=r"torchao is not installed .*pip install 'relaytrain\[lowbit\]'"):
        run(tiny_cfg("llama", "precision=amp_fp8"), tmp_path / "run", quiet=True)
