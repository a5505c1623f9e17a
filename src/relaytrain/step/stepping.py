"""The frame every relaytrain optimizer steps in (`StepEachGroup`), and torch's AdamW rule on a
group (`AdamWRule`), shared by `optim.py`'s FlatAdamW and `muon.py`'s AdamW groups."""

from __future__ import annotations

import torch
from torch.optim.adam import adam


class StepEachGroup:
    """The frame of torch.optim's `step` for relaytrain's optimizers: the closure (with autograd
    on), then `_update(group, params)` for each group, over its parameters with a gradient.

    `update()` is the same step without the closure and without the wrapper torch.optim puts
    around every `step` (a profiler range and the step hooks, which relaytrain never registers),
    and `drop_grads()` is `zero_grad(set_to_none=True)` without it: the eager param server
    steps each part with them, twice per part a step, where that wrapper cost more than the
    smallest parts' kernels (docs/benchmarks.md)."""

    kernel = "torch"  # what runs the update, for the run's results (the EPS reports it)

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


class AdamWRule:
    """torch's AdamW update of a parameter group, called as `torch.optim.AdamW(fused=True)` calls
    its kernel (the same step counts and arguments: bit for bit its numbers), without the Python
    torch.optim puts around it; unfused (a dry run, `optim.fused=false`), torch's functional
    `adam`, as AdamW's step would. A group carries AdamW's keys (betas, eps, weight_decay, fused,
    foreach, amsgrad, maximize, capturable); new state comes from the optimizer's `_zeros`.
    """

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        """torch's AdamW on `group`: its fused kernel, or its functional rule unfused."""
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
