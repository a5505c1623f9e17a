"""The keys every pipeline strategy has (its config group's schema; each strategy names itself).

No `from __future__ import annotations` here: the field types stay real types, so
`relaytrain train --help` lists each enum key's choices.
"""

import os
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from relaytrain.schema.config import Choice, Offload, Recompute, StrategyConfig, WorkersConfig
from relaytrain.utils.errors import ConfigError

LAYOUTS = ("balanced", "even")  # strategy.layout's words; otherwise a list of blocks per model chunk


class Execution(Choice):
    static = "static"
    message_driven = "message_driven"


@dataclass
class PipelineConfig(WorkersConfig, StrategyConfig):
    stages: int = 2  # pipeline depth: worker processes per replica, each holding consecutive blocks
    # Any: OmegaConf has no unions; `check_layout` takes balanced, even or a list.
    layout: Any = "balanced"  # blocks per stage: balanced (by each part's cost, the ends counted), even, or a list like [3,2,1]
    recompute: Recompute = Recompute.none  # block: each block's input kept; stage: each stage's input (2BW paper)
    offload: Offload = Offload.none  # host: fp32 masters and optimizer state in host memory, bucketed updates (AxoNN)
    execution: Execution = Execution.static  # message_driven: each stage runs whichever forward or backward has its input (AxoNN)


def check_layout(layout: Any, parts: int, num_layers: int, chunked: bool) -> None:
    """Refuse a `strategy.layout` that is neither one of LAYOUTS (or unset) nor `parts` positive
    block counts summing to the model's blocks (one per model chunk when `chunked`)."""
    if layout is None or (isinstance(layout, str) and layout in LAYOUTS):
        return
    given = list(layout) if OmegaConf.is_list(layout) or isinstance(layout, list) else None
    if given is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in given) \
            or len(given) != parts or sum(given) != num_layers or min(given) < 1:
        raise ConfigError(f"strategy.layout={given if given is not None else layout} must be balanced, "
                          f"even or {parts} positive block counts (one per "
                          f"{'model chunk' if chunked else 'stage'}) summing to model.num_layers={num_layers}")


# Batches a stage's program covers at most: the program is built before its first batch runs, in
# time and memory linear in its batches (train.steps=100000 spent 18 s building one before its
# first step). A program ends as a checkpoint's drain does (everything begun finishes): a flush
# every segment, which every schedule's weights survive as they survive a checkpoint (2BW's
# delayed rule included), at a pipeline fill's cost once per segment. The environment variable
# is for tests, which cross a segment's end in a few steps; read at each segment, as a worker
# receives its launcher's environment when it starts.
SEGMENT_BATCHES = 128
SEGMENT_VARIABLE = "RELAYTRAIN_PIPELINE_SEGMENT_BATCHES"


def segment_batches() -> int:
    return int(os.environ.get(SEGMENT_VARIABLE, SEGMENT_BATCHES))
