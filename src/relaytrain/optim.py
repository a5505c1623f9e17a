"""Optimizers (AdamW, LAMB, SGD), parameter groups and learning-rate schedules.

Every strategy builds its optimizers here, so the same config means the same update rule
whether the step runs on the device (baseline), on the host per block (the eager param
server) or per pipeline stage. The learning rate is set by the training loop each step from
`lr_at(step)`, which keeps the schedule position a plain integer (trivial to checkpoint).

The eager param server asks for the *flat* variants (`build_optimizer(..., flat=True)`): the
same update rules, bit for bit, with their state in one buffer per kind (`relaytrain.flat`)
and, for fused AdamW, one kernel call per parameter group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from relaytrain.flat import FlatState


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings only; biases and norm weights are not decayed."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], o, flat: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer; `flat`: its variant with flat state (FlatAdamW, FlatLamb, FlatSGD)."""
    groups = param_groups(named_params, o.weight_decay)
    if o.name == "adamw":
        # torch's fused AdamW runs on CPU and CUDA: one kernel over all tensors of a group. A dry
        # run (meta device) takes the multi-tensor kernel: the same state, no fused kernel there.
        meta = any(p.device.type == "meta" for g in groups for p in g["params"])
        return (FlatAdamW if flat else torch.optim.AdamW)(
            groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=o.fused and not meta, foreach=True if meta else None)
    if o.name == "lamb":
        return (FlatLamb if flat else Lamb)(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    return (FlatSGD if flat else torch.optim.SGD)(groups, lr=o.lr, momentum=o.momentum, foreach=True)


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


class _StepEachGroup:
    """The frame of torch.optim's `step` for relaytrain's optimizers: the closure (with autograd
    on), then `_update(group, params)` for each group, over its parameters with a gradient.

    `update()` is the same step without the closure and without the wrapper torch.optim puts
    around every `step` (a profiler range and the step hooks, which relaytrain never registers),
    and `drop_grads()` is `zero_grad(set_to_none=True)` without it: the eager param server
    steps each part with them, twice per part a step, where that wrapper cost more than the
    smallest parts' kernels (docs/benchmarks.md)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update()
        return loss

    def update(self) -> None:
        with torch.no_grad():
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    self._update(group, params)

    def drop_grads(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


class Lamb(_StepEachGroup, torch.optim.Optimizer):
    """LAMB (You et al., 2019): Adam's direction with a per-tensor trust ratio ||w|| / ||update||.

    The trust ratio is per tensor, so updating one block at a time (the eager param server)
    gives exactly the update of one whole-model step. Implemented with torch's multi-tensor
    (`_foreach`) kernels: one launch per operation over all tensors of a group.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if not state:
                state["step"] = 0
                state["exp_avg"] = self._zeros("exp_avg", p)
                state["exp_avg_sq"] = self._zeros("exp_avg_sq", p)
            state["step"] += 1
        self._lamb(group, params, grads, states)

    def _zeros(self, key: str, p: torch.Tensor) -> torch.Tensor:
        """New state `key` of `p` (`FlatState` puts it in its flat buffer instead)."""
        return torch.zeros_like(p)

    def _lamb(self, group, params, grads, states) -> None:
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


class FlatAdamW(_StepEachGroup, FlatState, torch.optim.AdamW):
    """torch's AdamW with its moments in flat buffers (`FlatState`). Fused, each parameter group
    is one call of torch's fused kernel, without the Python torch.optim puts around it.

    That Python (`_init_group`, grouping the tensors by device and dtype, checks) was paid per
    part and group, and was most of what the eager param server's per-part updates cost beyond
    one whole-model step (docs/benchmarks.md). The kernel, its arguments and the step counts
    are the ones `torch.optim.AdamW(fused=True)` uses, so the numbers are bit for bit its own
    (torch.amp's GradScaler, which hands a fused step its scale, is not used: relaytrain
    unscales itself). Unfused (a dry run, `optim.fused=false`), torch's functional `adam` runs,
    as AdamW's step would.
    """

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        states = [self._state(p, group) for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        max_exp_avg_sqs = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else []
        steps = [s["step"] for s in states]
        beta1, beta2 = group["betas"]
        rule = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"],
                "eps": group["eps"], "amsgrad": group["amsgrad"], "maximize": group["maximize"]}
        if not group["fused"]:
            adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=group["foreach"],
                 capturable=group["capturable"], decoupled_weight_decay=True, **rule)
            return
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, **rule)

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        """`p`'s state, made the first time as torch's `_init_group` makes it: the step count on
        the parameter's device for the fused kernel, on the CPU for the others (which read it
        with `.item()`), and zero moments."""
        state = self.state[p]
        if not state:
            device = p.device if group["fused"] or group["capturable"] else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = self._zeros("exp_avg", p)
            state["exp_avg_sq"] = self._zeros("exp_avg_sq", p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = self._zeros("max_exp_avg_sq", p)
        return state


class FlatLamb(FlatState, Lamb):
    """LAMB with its moments in flat buffers. Its math stays per tensor (the trust ratio is)."""


class FlatSGD(_StepEachGroup, FlatState, torch.optim.SGD):
    """torch's SGD with its momentum in a flat buffer: torch's functional `sgd` (foreach: one
    call per operation and group) over the flat views. torch makes a momentum buffer as a copy
    of the first gradient it sees; that copy moves into the flat buffer right after the step."""

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        rule = {"weight_decay": group["weight_decay"], "momentum": group["momentum"], "lr": group["lr"],
                "dampening": group["dampening"], "nesterov": group["nesterov"], "maximize": group["maximize"],
                "foreach": group["foreach"], "fused": group["fused"]}
        grads = [p.grad for p in params]
        if not group["momentum"]:
            sgd(params, grads, [], **rule)
            return
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        fresh = [p for p, buffer in zip(params, buffers, strict=True) if buffer is None]
        sgd(params, grads, buffers, **rule)  # fills the missing buffers with copies of the gradients
        for p, buffer in zip(params, buffers, strict=True):
            self.state[p]["momentum_buffer"] = buffer
        self._adopt(fresh)
