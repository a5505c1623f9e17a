"""Baseline: Algorithm 1 of the L2L paper.

All weights on the device; for each micro-batch, forward and backward through the whole
model; gradients accumulate over the micro-batches; one optimizer step per minibatch.
`strategy.recompute=block` checkpoints each block (its activations are recomputed in
backward), the fair in-memory comparison for L2L, which always recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from relaytrain.checkpoint import load_model_state, model_state, unique_named_parameters
from relaytrain.config import Recompute, StrategyConfig
from relaytrain.costmodel import (
    ModelFacts,
    Shape,
    StepCost,
    both,
    optimizer_s,
    powers_of_two_dividing,
    stage_bytes,
)
from relaytrain.errors import ConfigError
from relaytrain.evaluation import EvalStats
from relaytrain.models.layered import MicroBatch, eval_mode
from relaytrain.optim import build_optimizer, set_lr
from relaytrain.precision import LossScaler
from relaytrain.profile import Profile
from relaytrain.strategies import register
from relaytrain.strategies.base import (
    StepResult,
    Strategy,
    cpu_activation_bytes,
    minibatch_items,
    optimizer_tensors,
    scalar,
    weights_grads_optimizer_bytes,
)


@dataclass
class BaselineConfig(StrategyConfig):
    name: str = "baseline"
    recompute: Recompute = Recompute.none  # none, or block: keep each block's input, recompute it in backward


@register("baseline")
class Baseline(Strategy):
    Config = BaselineConfig

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.strategy.recompute == Recompute.stage:
            raise ConfigError("strategy.recompute=stage is for pipelines (the baseline is one stage); "
                              "use strategy.recompute=block")

    @classmethod
    def estimate_host_bytes(cls, cfg, num_params: int, device_type: str) -> int:
        # One micro-batch at a time: every block's activations, or (recompute) one block's and every block's input.
        live, stash = (1, cfg.model.num_layers) if cls.recomputes(cfg) else (cfg.model.num_layers, 0)
        return weights_grads_optimizer_bytes(cfg, num_params) + cpu_activation_bytes(cfg, device_type, live, stash)

    # -- what the planner asks --------------------------------------------------------------------
    @classmethod
    def shapes(cls, workers: int, batch: int, num_layers: int) -> list[Shape]:
        """One worker: every micro-batch size b dividing the batch (m = batch / b), with and
        without block recompute."""
        return [Shape(cls.name, b, batch // b, recompute=str(recompute))
                for b in powers_of_two_dividing(batch) for recompute in (Recompute.none, Recompute.block)]

    @classmethod
    def recomputes(cls, cfg) -> bool:
        return cfg.strategy.recompute == Recompute.block

    @classmethod
    def step_cost(cls, cfg, facts: ModelFacts, profile: Profile) -> StepCost:
        """L2L paper, Algorithm 1: per micro-batch, the embeddings, every block and the head
        forward and backward (block recompute: one more forward per block); then one optimizer
        step over the whole model."""
        s, n = cfg.strategy, facts.num_layers
        t = profile.for_workers(1, cfg.train.threads)
        block, embed, head = (t.part(part, s.microbatch_size) for part in ("block", "embed", "head"))
        recompute = block.forward_s if cls.recomputes(cfg) else 0.0
        compute = s.num_microbatches * (both(embed) + n * (both(block) + recompute) + both(head))
        optimizer = optimizer_s(t, facts, n, embed=True, head=True)
        return StepCost(compute + optimizer, {"compute": compute, "optimizer": optimizer})

    @classmethod
    def device_bytes(cls, cfg, facts: ModelFacts) -> int:
        """The whole model as one stage with one micro-batch in flight."""
        return stage_bytes(facts, cfg.strategy.microbatch_size, facts.num_layers, facts.params, last=True,
                           in_flight=1, versions=1, recompute=str(cfg.strategy.recompute))

    def __init__(self, model, cfg, world):
        super().__init__(model, cfg, world)
        model.to(self.device)
        self.optimizer = build_optimizer(model.named_parameters(), cfg.optim)
        self.scaler = LossScaler(self.precision.needs_loss_scaling, cfg.precision.loss_scale,
                                 cfg.precision.growth_interval)
        self.recompute = self.recomputes(cfg)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        items = minibatch_items(self.model, minibatch)
        loss_sum = torch.zeros((), device=self.device)
        with self.timer.phase("forward+backward"):
            for u, mb in enumerate(minibatch):
                self.progress(f"micro-batch {u + 1}/{len(minibatch)}")
                loss = self._loss(mb.to(self.device, non_blocking=True), items)
                self.scaler.scale_loss(loss).backward()
                loss_sum += loss.detach()
        with self.timer.phase("optimizer"):
            skipped = self._update(lr)
        return StepResult(loss=scalar(loss_sum), skipped=skipped)

    def evaluate(self, batches: list[list[MicroBatch]]) -> EvalStats:
        stats = EvalStats.zeros(self.model.num_labels)
        with eval_mode(self.model), torch.no_grad(), self.precision.autocast_context(self.device):
            for minibatch in batches:
                for mb in minibatch:
                    mb = mb.to(self.device)
                    stats += self.model.eval_stats(self._trunk(mb), mb.labels)
        return stats

    def memory_holders(self) -> dict[str, list]:
        return {"weights": self.params, "gradients": [p.grad for p in self.params],
                "optimizer state": optimizer_tensors([self.optimizer])}

    def report(self) -> dict:
        phases = dict(self.timer.totals)
        measured = max(self.timer.counts.get("optimizer", 0), 1)
        return {"phase_times_s": phases,
                "summary": {f"{name} (mean s/step)": f"{seconds / measured:.3f}" for name, seconds in phases.items()}}

    def _trunk(self, mb: MicroBatch) -> torch.Tensor:
        """Embeddings and every block: the last block's output."""
        hidden = self.model.embed(mb.input_ids)
        ctx = self.model.context(mb, hidden)
        for block in self.model.blocks:
            if self.recompute and torch.is_grad_enabled():
                hidden = checkpoint(block, hidden, ctx, use_reentrant=False)
            else:
                hidden = block(hidden, ctx)
        return hidden

    def _loss(self, mb: MicroBatch, items: int) -> torch.Tensor:
        with self.precision.autocast_context(self.device):
            return self.model.head_loss(self._trunk(mb), mb.labels) / items

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

    # -- state ----------------------------------------------------------------------------------
    def parameter_names(self) -> list[str]:
        return list(self.weights())

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in unique_named_parameters(self.model)}

    def state_dict(self) -> dict:
        params = [p for _, p in unique_named_parameters(self.model)]
        return model_state(self.model, params, [self.optimizer], self.scaler)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.model, [self.optimizer], self.scaler, state)
