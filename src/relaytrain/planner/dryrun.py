"""A dry run of a config for the planner: the real strategy code on the meta device, every
process of it (alike ones once), a couple of steps, nothing printed, and its simulated device
memory back.

It drives `relaytrain.run.train.run` like any caller; the trainer does not know the planner, so
nothing here is called back from a run. The accounting itself is `relaytrain.dryrun.memory`.

Alike processes run once. Where the strategy says a rank's dry run is exactly another's
(`Strategy.dry_run_stand_in`: a replica of the baseline, FSDP or a replicated-EPS L2L is
replica 0's; a pipeline stage's replica is that stage's replica 0), only that other one runs,
and its figures are the rank's too (`ProcessMemory.stand_in` says whose they are). Exact by
construction: the two run the same code on tensors of the same shapes, and a dry run passes
nothing between processes; the tests check it against the dry run of every process. It spares
most of a data-parallel dry run: 8 replicas of GPT-2 1.5 B (FSDP, or the baseline) took 3.2 to
3.4 s instead of 22 to 23 s in turns (42 to 45 s at once) on a 2-core machine.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from relaytrain.data.sources import Origin
from relaytrain.run.launch import dry_run_stand_ins
from relaytrain.run.resolve import choose, minibatch_samples
from relaytrain.run.train import run

# What a dry run leaves out: it computes nothing, so nothing that needs values.
DRY = (("train.device", "meta"), ("train.untimed_steps", 0), ("train.checkpoint_every", 0),
       ("train.save_model", False), ("train.resume", None), ("eval.every", 0), ("data.eval_fraction", 0.0),
       ("data.eval_path", None), ("data.eval_split", None), ("log.tensorboard", False),
       ("log.mlflow", False), ("log.mlflow_uri", None), ("log.wandb", False), ("log.wandb_project", None),
       ("train.check_memory", False))


@dataclass
class ProcessMemory:
    rank: int
    process: str
    peak_bytes: int
    by_kind: dict = field(default_factory=dict)
    stand_in: int | None = None  # the rank whose dry run these figures are (None: this one's)


# Beside the run's tensors, the CUDA allocator holds cuBLAS's workspaces for the process's life, one
# per thread that runs matrix products on a stream (the caller's forward, autograd's backward
# thread). Measured on an H100 (torch 2.11, CUDA 13, 2026-11-27: the allocator's snapshot after an
# L2L run): two of 32 MiB (cuBLAS's size from Hopper on; 4 MiB before) and one of 1 MiB. The
# planner's CUDA_HEADROOM covers it on a card; against the allocator's peak it is added.
CUDA_WORKSPACE_BYTES = (2 * 32 + 1) * 2**20


@dataclass
class Simulation:
    per_process: list[ProcessMemory]

    @property
    def peak_bytes(self) -> int:
        """The fullest process's peak device bytes of the run's tensors: what each device must hold."""
        return max(p.peak_bytes for p in self.per_process)

    @property
    def allocator_peak_bytes(self) -> int:
        """What `torch.cuda.max_memory_allocated` reports for the fullest process on a GPU: its
        tensors and cuBLAS's workspaces (`CUDA_WORKSPACE_BYTES`)."""
        return self.peak_bytes + CUDA_WORKSPACE_BYTES


def simulate(cfg, steps: int = 2, alike_once: bool = True) -> Simulation:
    """The simulated device memory of `cfg` (every process of it), from a dry run of `steps`
    steps on the meta device, here in this process, printing nothing. Alike processes run once
    (see above) unless `alike_once=False`."""
    dry = copy.deepcopy(cfg)
    for key, value in (*DRY, ("train.steps", steps)):
        OmegaConf.update(dry, key, value, merge=False)
    chosen = choose(dry)
    cls = chosen.strategy
    if chosen.source.origin is Origin.generated:  # only what the steps take: at 32 k tokens the
        # default 4,096 synthetic samples are a gigabyte of ids drawn for nothing
        OmegaConf.update(dry, "data.num_samples", steps * minibatch_samples(dry, cls), merge=False)
    token = dry_run_stand_ins.set(cls.dry_run_stand_in if alike_once else None)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            results = run(dry, run_dir, quiet=True)
    finally:
        dry_run_stand_ins.reset(token)
    per_process = results["memory"].get("per_process") or [
        {"rank": 0, "process": "rank 0", "device": results["memory"]["device"]}]
    # In rank order; a rank stood in for carries a copy of its stand-in's report, rank and all.
    return Simulation([ProcessMemory(rank, cls.describe_process(dry, rank) if len(per_process) > 1 else p["process"],
                                     p["device"]["peak_allocated_bytes"] or 0, p["device"].get("by_kind", {}),
                                     _whose(cls, dry, rank, alike_once))
                       for rank, p in enumerate(per_process)])


def _whose(cls, cfg, rank: int, alike_once: bool) -> int | None:
    """The rank whose dry run stood in for `rank`'s (strategy `cls`), None for its own."""
    stand_in = cls.dry_run_stand_in(cfg, rank) if alike_once else rank
    return None if stand_in == rank else stand_in
