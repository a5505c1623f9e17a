"""PipeDream-2BW: 1F1B without flushes and two weight versions per stage; each update uses the
gradients of the version one step older, W(t+1) = W(t) - lr * grad f(W(t-1))."""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.strategies import register
from relaytrain.strategies.base import Capabilities
from relaytrain.strategies.pipeline.runtime import PipelineConfig, PipelineStrategy
from relaytrain.strategies.pipeline.schedule import stop_vote_lag


@dataclass
class TwoBWConfig(PipelineConfig):
    name: str = "pipe_2bw"


@register("pipe_2bw")
class TwoBW(PipelineStrategy):
    Config = TwoBWConfig
    schedule = "pipe_2bw"
    capabilities = Capabilities(weight_versions=2, grad_clip=False, fp16=False)
    stop_lag = stop_vote_lag("pipe_2bw")  # the first stage runs a batch ahead of the last
