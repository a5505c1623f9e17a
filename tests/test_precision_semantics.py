"""`precision=` means one arithmetic whatever strategy runs it.

`amp_bf16` is fp32 master weights with the forward under `torch.autocast`: matmuls in bf16,
LayerNorm, softmax and the residual adds in fp32. FSDP once read it as FSDP2's
`MixedPrecisionPolicy` (bf16 parameters, every op in bf16): a run that drifted from the
baseline's by more than bf16 itself drifts from fp32. Measured against an fp32 run, fsdp's
`amp_bf16` must stay within a small fraction of bf16's own noise of the baseline's.
"""

from __future__ import annotations

import copy

import torch
from omegaconf import OmegaConf

from relaytrain.models import build_model
from relaytrain.run.train import run
from tests.conftest import tiny_cfg


def trained_weights(tmp_path, name: str, *overrides: str) -> torch.Tensor:
    """Every weight of a 2-step SGD run (SGD keeps a gradient's size: Adam's normalised first
    steps would turn bf16's noise in a near-zero gradient into a whole lr)."""
    cfg = tiny_cfg("gpt2", "optim=sgd", "train.steps=2", "train.save_model=true", "strategy.microbatch_size=2",
                   "strategy.num_microbatches=2", *overrides)
    run(cfg, tmp_path / name, quiet=True)
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(tmp_path / name / "model"))
    return torch.cat([p.detach().flatten() for p in build_model(saved.model).parameters()])


def test_amp_bf16_under_fsdp_is_the_baselines_arithmetic(tmp_path):
    fp32 = trained_weights(tmp_path, "fp32")
    baseline = trained_weights(tmp_path, "baseline", "precision=amp_bf16")
    fsdp = trained_weights(tmp_path, "fsdp", "precision=amp_bf16", "strategy=fsdp", "strategy.replicas=1")
    bf16_noise = (baseline - fp32).abs().max().item()
    assert bf16_noise > 0  # autocast did run in bf16: the comparison below means something
    # Half-precision parameters (the old policy) differed from the baseline by ~1.2x bf16_noise here;
    # the same arithmetic on one worker differs by nothing but the order of float sums.
    assert (fsdp - baseline).abs().max().item() <= 0.05 * bf16_noise
