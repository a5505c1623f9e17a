"""Optimizers and schedules: LAMB against its defining formula, LR schedule shapes."""

import copy
import itertools
import math

import pytest
import torch
from omegaconf import OmegaConf

from relaytrain.records import checkpoint
from relaytrain.run.train import run
from relaytrain.schema.config import OptimConfig
from relaytrain.step.optim import Lamb, LambConfig, build_optimizer, lr_at
from relaytrain.step.precision import LossScaler
from relaytrain.strategies.baseline import Baseline
from tests.conftest import tiny_cfg


def lamb_reference(w, g, m, v, step, lr, b1, b2, eps, wd, trust=True):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps) + wd * w
    ratio = w.norm() / update.norm() if trust else 1.0
    return w - lr * ratio * update, m, v


def test_lamb_matches_its_formula_over_several_steps():
    torch.manual_seed(0)
    w = torch.randn(8, 4)
    p = torch.nn.Parameter(w.clone())
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for step in range(1, 4):
        g = torch.randn(8, 4)
        p.grad = g.clone()
        opt.step()
        w, m, v = lamb_reference(w, g, m, v, step, 0.1, 0.9, 0.99, 1e-6, 0.01)
        torch.testing.assert_close(p.detach(), w)


def test_lamb_leaves_the_trust_ratio_out_where_there_is_no_weight_decay():
    """Built from a model's parameters: the bias (no decay) steps as Adam's direction times lr,
    the matrix (decayed) keeps its trust ratio; the flat variant (the EPS's) follows the same rule."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 8)
    grads = {"weight": torch.randn(8, 4), "bias": torch.randn(8)}
    o = OmegaConf.structured(LambConfig(lr=0.1, weight_decay=0.01, eps=1e-6))
    for flat in (False, True):
        net = copy.deepcopy(layer)
        w0 = {n: p.detach().clone() for n, p in net.named_parameters()}
        opt = build_optimizer(net.named_parameters(), o, flat=flat)
        for n, p in net.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        b1, b2 = o.betas
        bias, _, _ = lamb_reference(w0["bias"], grads["bias"], 0, 0, 1, 0.1, b1, b2, 1e-6, 0.0, trust=False)
        weight, _, _ = lamb_reference(w0["weight"], grads["weight"], 0, 0, 1, 0.1, b1, b2, 1e-6, 0.01)
        adam = w0["bias"] - 0.1 * (grads["bias"] / (grads["bias"].abs() + 1e-6))  # Adam's first step
        torch.testing.assert_close(net.bias.detach(), bias)
        torch.testing.assert_close(net.bias.detach(), adam)
        torch.testing.assert_close(net.weight.detach(), weight)
        untrusted, _, _ = lamb_reference(w0["weight"], grads["weight"], 0, 0, 1, 0.1, b1, b2, 1e-6, 0.01, trust=False)
        assert (weight - untrusted).abs().max() > 1e-3  # the ratio is far from 1 here: the two rules differ


def cfg(**kw):
    return OmegaConf.structured(OptimConfig(lr=1.0, **kw))


def test_warmup_is_linear_then_constant():
    o = cfg(warmup_steps=4)
    assert [lr_at(s, o, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule,mid", [("linear", 0.5), ("cosine", 0.5)])
def test_decay_schedules_fall_from_lr_to_zero(schedule, mid):
    o = cfg(schedule=schedule)
    assert lr_at(0, o, 10) == 1.0
    assert lr_at(5, o, 10) == pytest.approx(mid)
    assert lr_at(10, o, 10) == pytest.approx(0.0, abs=1e-12)
    assert all(lr_at(s, o, 10) >= lr_at(s + 1, o, 10) for s in range(10))
    assert not math.isnan(lr_at(0, o, 1))


def test_a_step_skipped_for_fp16_overflow_consumes_no_warmup_even_across_a_resume(monkeypatch, tmp_path):
    """The first step's overflow is forced (the scaler finds an inf once): the next step, the
    first applied update, gets update 0's LR; the checkpoint after it carries the count, and a
    checkpoint from before the count was saved gives it from its recorded skipped steps."""
    checks = itertools.count()
    check = LossScaler.unscale_and_check
    monkeypatch.setattr(LossScaler, "unscale_and_check",
                        lambda self, grads: check(self, grads) or next(checks) == 0)
    seen = []
    step = Baseline.step
    monkeypatch.setattr(Baseline, "step", lambda self, minibatch, lr: seen.append(lr) or step(self, minibatch, lr))
    cfg = tiny_cfg("bert", "precision=amp_fp16", "optim.lr=1.0", "optim.warmup_steps=4", "train.steps=3",
                   "train.checkpoint_every=1", "train.keep_checkpoints=0")
    results = run(cfg, tmp_path / "run", quiet=True)
    warmup = [lr_at(k, cfg.optim, 3) for k in range(2)]
    assert results["skipped_steps"] == 1 and seen == [warmup[0], *warmup]
    two = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "run"), 2)
    trainer = checkpoint.Checkpoint.trainer
    for saved in ("with the count", "without it"):
        if saved == "without it":  # as an older relaytrain wrote trainer.pt
            monkeypatch.setattr(checkpoint.Checkpoint, "trainer", lambda self: {
                k: v for k, v in trainer(self).items() if k != "applied_updates"})
        seen.clear()
        run(tiny_cfg("bert", "precision=amp_fp16", "optim.lr=1.0", "optim.warmup_steps=4", "train.steps=3",
                     f"train.resume={two}"), tmp_path / saved.replace(" ", "_"), quiet=True)
        assert seen == warmup[1:], saved
