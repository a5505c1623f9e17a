"""Optimizers and schedules: LAMB against its defining formula, LR schedule shapes."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from relaytrain.config import OptimConfig
from relaytrain.optim import Lamb, lr_at


def lamb_reference(w, g, m, v, step, lr, b1, b2, eps, wd):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps) + wd * w
    trust = w.norm() / update.norm()
    return w - lr * trust * update, m, v


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
