"""PipeDream-2BW: 1F1B without flushes and two weight versions per stage; each update uses the
gradients of the version one step older, W(t+1) = W(t) - lr * grad f(W(t-1)). The schedule
keeps the two versions and lets the first stage run a batch ahead of the last (its stop lag)."""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.strategies import register
from relaytrain.strategies.pipeline.runtime import PipelineConfig, PipelineStrategy
from relaytrain.strategies.pipeline.schedule import TwoBWSchedule


@dataclass
class TwoBWConfig(PipelineConfig):
    name: str = "pipe_2bw"


@register("pipe_2bw")
class TwoBW(PipelineStrategy):
    Config = TwoBWConfig
    schedule = TwoBWSchedule
