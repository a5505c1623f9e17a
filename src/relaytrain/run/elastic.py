"""Elastic restarts under torchrun: what a run does when torchelastic restarts its workers.

`torchrun --max-restarts N` restarts every worker of the run when one fails. Each attempt is a
new set of processes in the same run directory (its environment says which attempt it is:
TORCHELASTIC_RESTART_COUNT), so:
- its process groups live under the attempt's own store prefix (`launch._attempt_store`);
- `train.resume` left unset means `auto` under a restart policy: an attempt resumes from the
  newest complete checkpoint of the run directory;
- the run directory must be the same for every attempt and node: Hydra's time-stamped default
  (no `hydra.run.dir`) is refused;
- each attempt says where it resumed from, on the console and in `restarts.json` of the run
  directory, which results.json's `restarts` entry repeats (records of another torchrun launch,
  another TORCHELASTIC_RUN_ID, are dropped).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from relaytrain.placement.world import torchrun_attempt, torchrun_max_restarts, under_torchrun
from relaytrain.records import checkpoint
from relaytrain.utils.errors import ConfigError
from relaytrain.utils.files import write_json

RECORD = "restarts.json"  # in the run directory: every attempt of this torchrun launch, and its resume


def restartable() -> bool:
    """A torchrun launch that may restart its workers (torchrun --max-restarts > 0)."""
    return torchrun_max_restarts() > 0


def several_nodes() -> bool:
    return under_torchrun() and int(os.environ.get("GROUP_WORLD_SIZE") or 1) > 1


def prepare(cfg, device: torch.device):
    """The config an attempt runs on the run's `device`: `train.resume=auto` when the user left it
    unset under a restart policy (a dry run saves nothing to resume). Refuses a time-stamped run directory where attempts or nodes would differ."""
    if not (restartable() or several_nodes()):
        return cfg
    _check_run_dir()
    if resume_key(cfg.train.resume, device.type) != cfg.train.resume:
        cfg = copy.deepcopy(cfg)
        cfg.train.resume = "auto"
    return cfg


def resume_key(resume: str | None, device_type: str) -> str | None:
    """train.resume as an attempt runs with it: `auto` where the user left it unset under a
    restart policy (not for a dry run, which saves nothing to resume)."""
    return "auto" if resume is None and restartable() and device_type != "meta" else resume


def _check_run_dir() -> None:
    """Hydra's default run directory names the time it was made: each attempt and each node
    would write elsewhere, and a restart would find no checkpoint."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf
    except ImportError:
        return
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    key = "sweep" if hydra_cfg.mode == RunMode.MULTIRUN else "run"
    raw = OmegaConf.to_container(hydra_cfg[key], resolve=False).get("dir", "")
    if "${now:" in str(raw):
        why = "restarts" if restartable() else "several nodes"
        raise ConfigError(f"torchrun with {why} needs a run directory every attempt and node shares: "
                          f"give hydra.{key}.dir=DIR (the default, {raw}, differs between them)")


def resume_line(step: int, path: Path) -> str:
    """What the console says when a run resumes from `path` at `step`."""
    attempt = torchrun_attempt() if under_torchrun() else 0
    if attempt:
        return f"restart {attempt} of the run (torchrun attempt {attempt}): resuming from step {step} of {path}"
    return f"resuming from step {step} of {path}"


def announce_fresh_restart() -> None:
    """A restarted attempt that finds no complete checkpoint starts afresh: say so."""
    attempt = torchrun_attempt() if under_torchrun() else 0
    if attempt:
        print(f"restart {attempt} of the run (torchrun attempt {attempt}): no complete checkpoint yet, "
              f"starting from step 0", flush=True)


def record_attempt(run_dir: Path, resumed_from: Path | None) -> None:
    """Append this attempt (and the checkpoint it resumed from) to the run directory's record
    (the reporting process only); nothing without a torchrun restart policy."""
    if not restartable():
        return
    run_id, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), torchrun_attempt()
    # Earlier attempts of this launch only: a record of another launch, or of this attempt
    # number written before (a relaunch that reused the run id), does not belong to this run.
    entries = [e for e in _read(run_dir) if e.get("run_id") == run_id and e.get("attempt", 0) < attempt]
    match = checkpoint.STEP.match(resumed_from.name) if resumed_from is not None else None
    entries.append({"run_id": run_id, "attempt": attempt,
                    "resumed_from": str(resumed_from) if resumed_from is not None else None,
                    "step": int(match.group(1)) if match else 0})
    write_json(Path(run_dir) / RECORD, entries, indent=2)


def results_entry(run_dir: Path) -> dict:
    """results.json's `restarts`: how many restarts the run took and where each resumed from
    (only under torchrun with a restart policy)."""
    if not restartable():
        return {}
    run_id, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), torchrun_attempt()
    entries = [e for e in _read(run_dir) if e.get("run_id") == run_id and 0 < e.get("attempt", 0) <= attempt]
    return {"restarts": {"count": attempt, "max": torchrun_max_restarts(),
                         "resumed_from": [{"attempt": e["attempt"], "step": e["step"], "checkpoint": e["resumed_from"]}
                                          for e in entries]}}


def _read(run_dir: Path) -> list[dict]:
    try:
        entries = json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []
