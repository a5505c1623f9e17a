"""Execution strategies: where the weights live and in what order work runs.

`build_strategy` maps `strategy.name` to its class. Pipelines run in several processes and
enter through `relaytrain.strategies.pipeline` instead (see `train.run`).
"""

from __future__ import annotations

from relaytrain.strategies.base import StepResult, Strategy
from relaytrain.strategies.baseline import Baseline

__all__ = ["StepResult", "Strategy", "build_strategy", "PIPELINE_STRATEGIES"]

PIPELINE_STRATEGIES = ("pipe_2bw", "pipe_flush")


def build_strategy(model, cfg, device, precision) -> Strategy:
    name = cfg.strategy.name
    if name == "baseline":
        return Baseline(model, cfg, device, precision)
    if name in ("l2l", "l2l_stash_cpu"):
        from relaytrain.strategies.l2l import L2L

        return L2L(model, cfg, device, precision)
    raise ValueError(f"strategy {name!r} runs in several processes; start it through relaytrain.train.run")
