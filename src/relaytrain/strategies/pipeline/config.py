"""The keys every pipeline strategy has (its config group's schema; each strategy names itself).

No `from __future__ import annotations` here: the field types stay real types, so
`relaytrain train --help` lists each enum key's choices.
"""

from dataclasses import dataclass
from typing import Any

from relaytrain.config import Choice, Recompute, StrategyConfig, WorkersConfig


class Offload(Choice):
    none = "none"
    host = "host"


class Execution(Choice):
    static = "static"
    message_driven = "message_driven"


@dataclass
class PipelineConfig(WorkersConfig, StrategyConfig):
    stages: int = 2  # pipeline depth: worker processes per replica, each holding consecutive blocks
    # Any: OmegaConf has no unions; `check_config` takes balanced, even or a list.
    layout: Any = "balanced"  # blocks per stage: balanced (by each part's cost, the ends counted), even, or a list like [3,2,1]
    recompute: Recompute = Recompute.none  # block: each block's input kept; stage: each stage's input (2BW paper)
    offload: Offload = Offload.none  # host: fp32 masters and optimizer state in host memory, bucketed updates (AxoNN)
    execution: Execution = Execution.static  # message_driven: each stage runs whichever forward or backward has its input (AxoNN)
