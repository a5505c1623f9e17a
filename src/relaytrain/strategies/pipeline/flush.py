"""PipeDream-Flush: 1F1B across stages with a flush per minibatch, one weight version: the
baseline's weight updates (vanilla semantics), pipelined."""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.strategies import register
from relaytrain.strategies.pipeline.runtime import PipelineConfig, PipelineStrategy
from relaytrain.strategies.pipeline.schedule import FlushSchedule


@dataclass
class FlushConfig(PipelineConfig):
    name: str = "pipe_flush"


@register("pipe_flush")
class Flush(PipelineStrategy):
    Config = FlushConfig
    schedule = FlushSchedule
