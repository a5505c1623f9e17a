"""Baseline: Algorithm 1 of the L2L paper.

All weights on the device; for each micro-batch, forward and backward through the whole
model; gradients accumulate over the micro-batches; one optimizer step per minibatch.
`strategy.recompute=true` checkpoints each block (its activations are recomputed in
backward), the fair in-memory comparison for L2L, which always recomputes.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from relaytrain.models.layered import MicroBatch
from relaytrain.optim import build_optimizer, set_lr
from relaytrain.precision import LossScaler
from relaytrain.strategies.base import StepResult, Strategy, minibatch_items


class Baseline(Strategy):
    name = "baseline"

    def __init__(self, model, cfg, device, precision):
        super().__init__(model, cfg, device, precision)
        model.to(device)
        self.optimizer = build_optimizer(model.named_parameters(), cfg.optim)
        self.scaler = LossScaler(precision.needs_loss_scaling, cfg.precision.loss_scale, cfg.precision.growth_interval)
        self.recompute = cfg.strategy.recompute
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        items = minibatch_items(self.model, minibatch)
        loss_sum = torch.zeros((), device=self.device)
        for mb in minibatch:
            loss = self._loss(mb.to(self.device, non_blocking=True), items)
            self.scaler.scale_loss(loss).backward()
            loss_sum += loss.detach()
        skipped = self._update(lr)
        return StepResult(loss=float(loss_sum), skipped=skipped)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def _loss(self, mb: MicroBatch, items: int) -> torch.Tensor:
        with self.precision.autocast_context(self.device):
            hidden = self.model.embed(mb.input_ids)
            ctx = self.model.context(mb, hidden)
            for block in self.model.blocks:
                if self.recompute:
                    hidden = checkpoint(block, hidden, ctx, use_reentrant=False)
                else:
                    hidden = block(hidden, ctx)
            return self.model.head_loss(hidden, mb.labels) / items

    def _update(self, lr: float) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        overflow = self.scaler.unscale_and_check(grads)
        if not overflow:
            if self.cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip, foreach=True)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        return overflow
