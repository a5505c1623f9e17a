"""Before the first step: how long will a step, and the run, take on this machine?

A prediction, labelled as one, by the planner's own cost model (`relaytrain.planner.plan.predict`):
one block of the configured model is profiled briefly on this machine (forward, backward and
an optimizer step at micro-batch sizes up to the configured one; larger sizes extrapolated
once a block passes a fraction of a second), and the strategy's step is composed from it as
`relaytrain plan` composes every candidate's (`CostModel.step_cost`). On a GPU the line adds
the device memory of the meta-device dry run. It tells a user in one line whether to wait
seconds or days, and `relaytrain plan` and `relaytrain train` never disagree about a config.
The command (`relaytrain train`) makes it and hands it to the trainer, which only shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaytrain.cost.formulas import microbatch_rows
from relaytrain.cost.work import model_flops_per_token
from relaytrain.planner.plan import predict
from relaytrain.run.resolve import choose
from relaytrain.utils.errors import ConfigError
from relaytrain.utils.units import GiB, duration

LONG_RUN_S = 3600.0


@dataclass(frozen=True)
class Estimate:
    step_s: float
    run_s: float
    flops_per_step: float
    device_memory_bytes: int | None  # the dry run's peak, where there is a separate device
    sampled: bool = False  # an online objective's rows: the step includes its share of sampling them

    def line(self, steps: int, device: torch.device) -> str:
        text = (f"estimate (a prediction): about {duration(self.step_s)} a step, {duration(self.run_s)} for "
                f"{steps} steps on this {device.type} (the planner's cost model over one block profiled here; "
                f"{self.flops_per_step / 1e12:.3g} TFLOP a step")
        if self.device_memory_bytes is not None:
            text += f", {self.device_memory_bytes / GiB:.2f} GiB of device memory, simulated"
        text += ")"
        if self.sampled:
            text += ("; the step includes its share of sampling the completions, predicted from reading the weights "
                     "once a decoded token (a run measures it as rollout_s)")
        if device.type == "cpu" and self.run_s > LONG_RUN_S:
            text += ("; this config is meant for a GPU: to try it on this CPU, shorten it, e.g. train.steps=3 "
                     "model.num_layers=2 strategy.microbatch_size=2 strategy.num_microbatches=1")
        return text


def step_flops(cfg, cls) -> float:
    """Model FLOPs of a step (`cost.work.model_flops_per_token`: every block and the head, forward
    and backward), and one forward more (forward + 2 x backward + forward: 4/3) where the
    strategy recomputes in backward."""
    m, s = cfg.model, cfg.strategy
    tokens = microbatch_rows(cfg) * s.num_microbatches * cls.replicas(cfg) * cfg.data.seq_len  # a pair's both rows
    per_token = model_flops_per_token(m, cfg.data.seq_len)
    return per_token * tokens * (4 / 3 if cls.cost_model.recomputes(cfg) else 1.0)


def estimate(cfg, cls) -> Estimate | None:
    """The cost model's step for `cfg` on this machine; None where it cannot be profiled here."""
    try:
        with torch.random.fork_rng(devices=[]):  # the profile's random weights leave the run's RNG as it was
            prediction = predict(cfg)
    except ConfigError:
        return None
    step = prediction.step_time_s
    return Estimate(step, step * cfg.train.steps, step_flops(cfg, cls), prediction.device_memory_bytes,
                    sampled=choose(cfg).objective.learns_online)
