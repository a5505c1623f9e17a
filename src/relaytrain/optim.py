"""Optimizers (AdamW, LAMB, SGD), parameter groups and learning-rate schedules.

Every strategy builds its optimizers here, so the same config means the same update rule
whether the step runs on the device (baseline), on the host per block (the eager param
server) or per pipeline stage. The learning rate is set by the training loop each step from
`lr_at(step)`, which keeps the schedule position a plain integer (trivial to checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings only; biases and norm weights are not decayed."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], o) -> torch.optim.Optimizer:
    groups = param_groups(named_params, o.weight_decay)
    if o.name == "adamw":
        # torch's fused AdamW runs on CPU and CUDA: one kernel over all tensors of a group. A dry
        # run (meta device) takes the multi-tensor kernel: the same state, no fused kernel there.
        meta = any(p.device.type == "meta" for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=o.fused and not meta,
                                 foreach=True if meta else None)
    if o.name == "lamb":
        return Lamb(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, foreach=True)


def state_words(o) -> int:
    """fp32 words of optimizer state per parameter: two moments for AdamW and LAMB, SGD's momentum."""
    if o.name == "sgd":
        return 1 if o.momentum else 0
    return 2


def lr_at(step: int, o, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    decay_steps = max(total_steps - o.warmup_steps, 1)
    progress = min((step - o.warmup_steps) / decay_steps, 1.0)
    if o.schedule == "linear":
        return o.lr * (1.0 - progress)
    return o.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019): Adam's direction with a per-tensor trust ratio ||w|| / ||update||.

    The trust ratio is per tensor, so updating one block at a time (the eager param server)
    gives exactly the update of one whole-model step. Implemented with torch's multi-tensor
    (`_foreach`) kernels: one launch per operation over all tensors of a group.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            states = [self.state[p] for p in params]
            for p, state in zip(params, states, strict=True):
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
            self._update(group, params, grads, states)
        return loss

    def _update(self, group, params, grads, states) -> None:
        beta1, beta2 = group["betas"]
        step = states[0]["step"]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
        # Adam direction with bias correction, plus decoupled weight decay.
        m_hat = torch._foreach_div(exp_avg, 1 - beta1**step)
        denom = torch._foreach_sqrt(torch._foreach_div(exp_avg_sq, 1 - beta2**step))
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(m_hat, denom)
        if group["weight_decay"]:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        w_norms = torch._foreach_norm(params)
        u_norms = torch._foreach_norm(update)
        for p, u, w_norm, u_norm in zip(params, update, w_norms, u_norms, strict=True):
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            p.add_(u * trust, alpha=-group["lr"])
