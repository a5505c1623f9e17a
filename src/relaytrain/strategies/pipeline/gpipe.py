"""GPipe: every forward of a minibatch, then every backward, then a flush; one weight version.
The comparison the PipeDream-2BW paper draws (its Figures 1a and 3): the same updates as
PipeDream-Flush, with every micro-batch's activations alive at once."""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.strategies import register
from relaytrain.strategies.pipeline.runtime import PipelineConfig, PipelineStrategy
from relaytrain.strategies.pipeline.schedule import GPipeSchedule


@dataclass
class GPipeConfig(PipelineConfig):
    name: str = "pipe_gpipe"


@register("pipe_gpipe")
class GPipe(PipelineStrategy):
    Config = GPipeConfig
    schedule = GPipeSchedule
