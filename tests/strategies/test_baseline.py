"""Baseline (Algorithm 1) equals a plain PyTorch loop over the same Hugging Face model and data."""

import copy

import pytest
import torch

from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.step.optim import lr_at
from relaytrain.strategies import build_strategy
from tests.conftest import tiny_cfg

STEPS = 4


def train_baseline(cfg):
    model = build_model(cfg.model, seed=cfg.train.seed)
    strategy = build_strategy(model, cfg)
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    losses = [strategy.step(next(loader), lr_at(s, cfg.optim, STEPS)).loss for s in range(STEPS)]
    return model.hf_model, losses


def train_plain_pytorch(cfg):
    """The reference: Hugging Face forward on the whole minibatch at once, torch's AdamW."""
    hf_model = copy.deepcopy(build_model(cfg.model, seed=cfg.train.seed).hf_model)
    decay = [p for p in hf_model.parameters() if p.ndim >= 2]
    no_decay = [p for p in hf_model.parameters() if p.ndim < 2]
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=tuple(o.betas), eps=o.eps,
    )
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    losses = []
    for _ in range(STEPS):
        mbs = next(loader)
        ids = torch.cat([mb.input_ids for mb in mbs])
        labels = torch.cat([mb.labels for mb in mbs])
        loss = hf_model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return hf_model, losses


def assert_same_weights(a, b, atol=2e-5):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("recompute", ["none", "block"])
def test_baseline_weights_equal_a_plain_pytorch_loop(family, recompute):
    cfg = tiny_cfg(family, "strategy.microbatch_size=4", "strategy.num_microbatches=4",
                   f"strategy.recompute={recompute}", "optim.lr=1e-3")
    ours, our_losses = train_baseline(cfg)
    ref, ref_losses = train_plain_pytorch(cfg)
    assert_same_weights(ours, ref)
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    assert our_losses[-1] < our_losses[0]


def test_micro_batch_count_does_not_change_the_update():
    one = tiny_cfg("bert", "strategy.microbatch_size=16", "strategy.num_microbatches=1", "data.shuffle=false")
    many = tiny_cfg("bert", "strategy.microbatch_size=2", "strategy.num_microbatches=8", "data.shuffle=false")
    assert_same_weights(train_baseline(one)[0], train_baseline(many)[0])


@pytest.mark.parametrize("optim", ["lamb", "sgd"])
def test_every_optimizer_trains(optim):
    cfg = tiny_cfg("bert", f"optim={optim}", "strategy.microbatch_size=8", "strategy.num_microbatches=2")
    _, losses = train_baseline(cfg)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_amp_bf16_trains_with_finite_falling_loss():
    cfg = tiny_cfg("bert", "precision=amp_bf16", "optim.lr=2e-3", "strategy.microbatch_size=8",
                   "strategy.num_microbatches=2")
    _, losses = train_baseline(cfg)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    cfg = tiny_cfg("bert", "precision=amp_fp16", "precision.loss_scale=1e38")
    model = build_model(cfg.model)
    strategy = build_strategy(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = strategy.step(next(iter(build_loader(cfg, build_dataset(cfg)))), lr=1e-3)
    assert result.skipped
    assert strategy.scaler.scale < 1e38
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p), n


def test_global_norm_clipping_bounds_the_update():
    cfg = tiny_cfg("bert", "optim=sgd", "optim.momentum=0.0", "optim.lr=1.0", "optim.grad_clip=1e-3")
    model = build_model(cfg.model)
    strategy = build_strategy(model, cfg)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    strategy.step(next(iter(build_loader(cfg, build_dataset(cfg)))), lr=1.0)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float((after - before).norm()) == pytest.approx(1e-3, rel=1e-3)
