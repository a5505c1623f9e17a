"""Interleaved 1F1B (Narayanan et al., 2021): each stage holds `strategy.chunks` model chunks,
blocks assigned round-robin (stage s of d holds the model's chunks s, s + d, ...), so the
pipeline's fill and drain take 1/v of the time: the bubble falls from (d - 1)/(m + d - 1) to
(d - 1)/(v m + d - 1) of stage time, for v times the point-to-point messages. A flush per
minibatch and one weight version: the plain loop's updates, pipelined. Its order across chunks
is the schedule's own, so execution is static; m must be a multiple of d (Megatron's rule)."""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.strategies import register
from relaytrain.strategies.pipeline.cost import InterleavedCost
from relaytrain.strategies.pipeline.runtime import PipelineConfig, PipelineStrategy
from relaytrain.strategies.pipeline.schedule import InterleavedSchedule
from relaytrain.utils.errors import ConfigError


@dataclass
class InterleavedConfig(PipelineConfig):
    name: str = "pipe_interleaved"
    chunks: int = 2  # v: model chunks per stage (blocks round-robin: stage s holds chunks s, s+d, ...)


@register("pipe_interleaved")
class Interleaved(PipelineStrategy):
    Config = InterleavedConfig
    schedule = InterleavedSchedule
    cost_model = InterleavedCost  # also tries two and four chunks a stage

    @classmethod
    def chunks(cls, cfg) -> int:
        return cfg.strategy.chunks

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.strategy.chunks < 1:
            raise ConfigError(f"strategy.chunks={cfg.strategy.chunks} must be at least 1 (1: plain 1F1B, as pipe_flush)")
        super().check_config(cfg)
