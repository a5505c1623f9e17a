"""What every strategy offers the training loop.

A strategy owns *where the weights live* and *in what order work runs*; the loop only hands
it one minibatch (a list of micro-batches) and the learning rate per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from relaytrain.models.layered import LayeredModel, MicroBatch
from relaytrain.precision import Precision


@dataclass
class StepResult:
    loss: float  # mean loss of the minibatch (over its loss items)
    skipped: bool = False  # fp16 overflow: no weight changed


class Strategy(ABC):
    name = ""

    def __init__(self, model: LayeredModel, cfg, device: torch.device, precision: Precision):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.precision = precision

    @abstractmethod
    def step(self, minibatch: list[MicroBatch], lr: float) -> StepResult:
        """Forward and backward over every micro-batch, then one update of every weight."""

    def sync_model(self) -> None:
        """Make `model.hf_model` hold the current trained weights (before saving or comparing)."""

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer the strategy steps; their state is checkpointed by parameter name."""
        return []

    def weights_loaded(self) -> None:
        """Called after a checkpoint overwrote the weights: refresh anything derived from them."""

    def report(self) -> dict:
        """Strategy-specific figures for results.json (phase times, resident blocks, ...)."""
        return {}

    def close(self) -> None:
        """Release workers and buffers."""


def minibatch_items(model: LayeredModel, minibatch: list[MicroBatch]) -> int:
    """Loss items of the whole minibatch: each micro-batch's summed loss is divided by this."""
    return sum(model.loss_items(mb.labels) for mb in minibatch)
