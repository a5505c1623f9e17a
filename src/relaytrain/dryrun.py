"""A dry run of a config for the planner: the real strategy code on the meta device, every
process of it, a couple of steps, nothing printed, and its simulated device memory back.

It drives `relaytrain.train.run` like any caller; the trainer does not know the planner, so
nothing here is called back from a run. The accounting itself is `relaytrain.memory`.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from relaytrain.train import run

# What a dry run leaves out: it computes nothing, so nothing that needs values.
DRY = (("train.device", "meta"), ("train.warmup_steps", 0), ("train.checkpoint_every", 0),
       ("train.save_model", False), ("train.resume", None), ("eval.every", 0), ("data.eval_fraction", 0.0),
       ("data.eval_path", None), ("data.eval_split", None), ("log.tensorboard", False),
       ("train.check_memory", False))


@dataclass
class ProcessMemory:
    rank: int
    process: str
    peak_bytes: int
    by_kind: dict = field(default_factory=dict)


@dataclass
class Simulation:
    per_process: list[ProcessMemory]

    @property
    def peak_bytes(self) -> int:
        """The fullest process's peak device bytes: what each device must hold."""
        return max(p.peak_bytes for p in self.per_process)


def simulate(cfg, steps: int = 2) -> Simulation:
    """The simulated device memory of `cfg` (every process of it), from a dry run of `steps`
    steps on the meta device, here in this process, printing nothing."""
    dry = copy.deepcopy(cfg)
    for key, value in (*DRY, ("train.steps", steps)):
        OmegaConf.update(dry, key, value, merge=False)
    with tempfile.TemporaryDirectory() as run_dir:
        results = run(dry, run_dir, quiet=True)
    per_process = results["memory"].get("per_process") or [
        {"rank": 0, "process": "rank 0", "device": results["memory"]["device"]}]
    return Simulation([ProcessMemory(p["rank"], p["process"], p["device"]["peak_allocated_bytes"] or 0,
                                     p["device"].get("by_kind", {})) for p in per_process])
