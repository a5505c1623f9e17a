"""Before the first step: how long will a step, and the run, take on this machine?

A prediction, labelled as one: the model's training FLOPs per step (6N per token plus
attention, times 4/3 where the strategy recomputes its forward) over the rate this machine
sustains, measured by a short calibration (a fraction of a second of matmuls shaped like the
model's feed-forward layer), divided by the efficiency a whole training step achieves
against bare matmuls (`STEP_EFFICIENCY`, measured on this project's CPU runs: see
docs/benchmarks.md). It tells a user in one line whether to wait seconds or days.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from relaytrain import metrics
from relaytrain.models import count_parameters

STEP_EFFICIENCY = 0.5  # a training step's FLOP/s over the calibrated matmul FLOP/s (CPU, measured)
CALIBRATION_S = 0.3
LONG_RUN_S = 3600.0


@dataclass(frozen=True)
class Estimate:
    step_s: float
    run_s: float
    flops_per_step: float
    machine_flops_per_s: float

    def line(self, steps: int, device: torch.device) -> str:
        text = (f"estimate (a prediction): about {duration(self.step_s)} a step, {duration(self.run_s)} for "
                f"{steps} steps on this {device.type} ({self.flops_per_step / 1e12:.3g} TFLOP a step, the machine "
                f"sustains ~{self.machine_flops_per_s / 1e9:.0f} GFLOP/s on matmuls)")
        if device.type == "cpu" and self.run_s > LONG_RUN_S:
            text += ("; this config is meant for a GPU: to try it on this CPU, shorten it, e.g. train.steps=3 "
                     "model.num_layers=2 strategy.microbatch_size=2 strategy.num_microbatches=1")
        return text


def recompute_factor(cfg) -> float:
    """Forward recomputed in backward: one forward more on top of forward + 2 x backward."""
    recompute = str(getattr(cfg.strategy, "recompute", "none"))
    always = str(cfg.strategy.name).startswith("l2l")
    return 4 / 3 if always or recompute in ("block", "stage") else 1.0


def step_flops(cfg, cls) -> float:
    m, s = cfg.model, cfg.strategy
    tokens = s.microbatch_size * s.num_microbatches * cls.replicas(cfg) * cfg.data.seq_len
    per_token = metrics.model_flops_per_token(count_parameters(m), m.num_layers, m.hidden_size, cfg.data.seq_len)
    return per_token * tokens * recompute_factor(cfg)


def calibrate(device: torch.device, hidden: int) -> float:
    """Matmul FLOP/s this device sustains at the model's width, over CALIBRATION_S seconds."""
    if device.type == "meta":
        return float("inf")
    rows, width = 512, max(64, min(hidden, 2048))
    a = torch.randn(rows, width, device=device)
    b = torch.randn(width, 4 * width, device=device)
    flops, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < CALIBRATION_S:
        a @ b
        metrics.synchronize(device)
        flops += 2.0 * rows * width * 4 * width
    return flops / (time.perf_counter() - start)


def estimate(cfg, cls, device: torch.device) -> Estimate:
    rate = calibrate(device, cfg.model.hidden_size)
    flops = step_flops(cfg, cls)
    step = flops / (rate * STEP_EFFICIENCY)
    return Estimate(step, step * cfg.train.steps, flops, rate)


def duration(seconds: float) -> str:
    """A human duration: 0.3 s, 12 s, 4 min, 2.5 h, 3.1 days."""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
