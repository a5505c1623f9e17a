"""The frame every relaytrain optimizer steps in (`StepEachGroup`), shared by the rules in
`optim.py` and `muon.py`."""

from __future__ import annotations

import torch


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
