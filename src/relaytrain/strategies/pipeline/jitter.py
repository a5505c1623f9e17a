"""A benchmarking and testing aid, not a training feature: slow one stage by a seeded jitter.

    RELAYTRAIN_STAGE_JITTER="stage=1,max=0.3,seed=0" relaytrain train strategy=pipe_flush ...

After each forward and each backward of micro-batch k, the named stage sleeps for a fraction
of that computation's own time, drawn uniformly from [0, max) by a generator seeded with
(seed, stage, k, forward or backward): the same delays whatever order the stage runs its
work in, and whether or not the run was resumed. It imitates a stage whose speed varies
(a shared or throttled GPU, uneven layers), the situation message-driven execution is for.
The sleep is wall time inside the stage's forward and backward phases (on CUDA after a
synchronize, so it is time the device would have been busy); it draws nothing from torch's
RNG, so it changes no number. Every stage's report names the setting and the delay it
added, and the run's summary says a delay was injected.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from relaytrain.utils.errors import ConfigError

ENV = "RELAYTRAIN_STAGE_JITTER"
FORMAT = "stage=S,max=F[,seed=N] (e.g. stage=1,max=0.3,seed=0)"


@dataclass
class StageJitter:
    stage: int  # the stage slowed
    max_fraction: float  # each delay is U[0, max_fraction) times the computation's own time
    seed: int = 0
    added_s: float = 0.0  # delay added so far by this process

    @classmethod
    def from_environment(cls) -> StageJitter | None:
        """The setting of RELAYTRAIN_STAGE_JITTER, None when unset; a bad value is a ConfigError."""
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            jitter = cls(int(fields.pop("stage")), float(fields.pop("max")), int(fields.pop("seed", 0)))
        except (KeyError, ValueError):
            jitter = None
        if jitter is None or fields or jitter.stage < 0 or not 0.0 <= jitter.max_fraction <= 10.0:
            raise ConfigError(f"{ENV}={text!r}: expected {FORMAT}, max between 0 and 10")
        return jitter

    @contextmanager
    def around(self, op: str, microbatch: int, device: torch.device):
        """Run the computation inside, then sleep its jittered share."""
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fraction = random.Random(f"{self.seed}:{self.stage}:{microbatch}:{op}").uniform(0.0, self.max_fraction)
        delay = fraction * (time.perf_counter() - start)
        time.sleep(delay)
        self.added_s += delay

    def describe(self) -> str:
        return f"stage {self.stage} slowed by U[0, {self.max_fraction:.0%}) per micro-batch (seed {self.seed})"

    def report(self) -> dict:
        return {"stage": self.stage, "max_fraction": self.max_fraction, "seed": self.seed, "added_s": self.added_s,
                "note": f"benchmarking aid ({ENV}), not training work"}
