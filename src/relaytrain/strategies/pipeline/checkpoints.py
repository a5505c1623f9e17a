"""Pipeline checkpoints: one part per stage, and a checkpoint counts only when every part is on disk.

    RUN_DIR/checkpoints/step-00000010/        stage-0.pt ... stage-{d-1}.pt, manifest.json: complete
    RUN_DIR/checkpoints/step-00000020.parts/  a save in progress, or one a crash cut short: ignored

Each stage (replica 0's worker) writes its part into the `.parts` directory atomically
(`checkpoint.atomic_write`). After a barrier, rank 0 writes the manifest (what was saved, by
which config, each part's size) and renames the directory to its final name: a directory
without the `.parts` suffix whose manifest's parts are all there, at their recorded sizes, is
a complete checkpoint, and nothing else is. Older complete ones beyond `train.keep_checkpoints`
are removed manifest first, so a crash mid-removal leaves an incomplete one, never a wrong one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from relaytrain.checkpoint import atomic_write, identity, latest_under
from relaytrain.errors import ConfigError
from relaytrain.strategies.pipeline.stage import partition

FORMAT = 1
MANIFEST = "manifest.json"
STEP = re.compile(r"^step-(\d{8})$")
STAGING = re.compile(r"^step-(\d{8})\.parts$")


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def part_name(stage: int) -> str:
    return f"stage-{stage}.pt"


def manifest(cfg, step: int) -> dict:
    """What a resumed run must match: the model and update rule, the strategy, the stage split."""
    return {
        "format": FORMAT,
        "step": step,
        "strategy": cfg.strategy.name,
        "layout": layout(cfg),
        "identity": identity(cfg),
    }


def layout(cfg) -> list[int]:
    s = cfg.strategy
    return [len(blocks) for blocks in partition(cfg.model.num_layers, s.stages, s.layout)]


# ------------------------------------------------------------------------------ writing


def write_part(directory: Path, step: int, stage: int, part: dict) -> None:
    staging = _staging_dir(directory, step)
    staging.mkdir(parents=True, exist_ok=True)
    atomic_write(staging / part_name(stage), lambda f: torch.save(part, f))


def publish(directory: Path, step: int, contents: dict, keep: int) -> Path:
    """Make the staged parts of `step` a complete checkpoint; call once every part is written."""
    staging, final = _staging_dir(directory, step), step_dir(directory, step)
    parts = [part_name(stage) for stage in range(len(contents["layout"]))]
    record = {**contents, "parts": {name: (staging / name).stat().st_size for name in parts}}
    atomic_write(staging / MANIFEST, lambda f: f.write(json.dumps(record, indent=1).encode()))
    if final.exists():  # saved before by a run that was resumed from an earlier step
        _remove(final)
    os.replace(staging, final)
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        _remove(old)
    return final


def remove_staging(directory: Path) -> None:
    """Drop the parts of saves a crash cut short (before any worker writes new ones)."""
    if directory.is_dir():
        for path in directory.iterdir():
            if STAGING.match(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _staging_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.parts"


def _remove(path: Path) -> None:
    (path / MANIFEST).unlink(missing_ok=True)  # first: from here on it is incomplete
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ finding


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete pipeline checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if STEP.match(p.name) and is_complete(p))


def is_complete(path: Path) -> bool:
    try:
        record = json.loads((path / MANIFEST).read_text())
        return all((path / name).stat().st_size == size for name, size in record["parts"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def find(resume: str, run_dir: Path) -> Path | None:
    """Like `checkpoint.find` for pipelines: `auto` is this run directory's latest complete
    checkpoint (None if there is none yet); otherwise a step-N directory, a checkpoints
    directory or a run directory (its latest complete one)."""
    if resume == "auto":
        return latest_under(run_dir, list_checkpoints)
    path = Path(resume).expanduser()
    if STEP.match(path.name) and path.is_dir():
        if not is_complete(path):
            raise ConfigError(f"train.resume={resume}: this pipeline checkpoint is incomplete (a stage's part is "
                              f"missing or cut short); resume from an earlier one")
        return path
    if path.is_file():
        raise ConfigError(f"train.resume={resume} is a single-process checkpoint; pipe_flush and pipe_2bw resume "
                          f"from a pipeline checkpoint (a step-N directory of stage parts)")
    latest = latest_under(path, list_checkpoints)
    if latest is not None:
        return latest
    raise ConfigError(f"train.resume={resume}: no complete pipeline checkpoint there; give a step-N directory, "
                      f"its checkpoints directory or a run directory")


# ------------------------------------------------------------------------------ loading


def check_fits(path: Path, cfg) -> int:
    """Refuse a checkpoint this config cannot continue; return its step."""
    record = json.loads((path / MANIFEST).read_text())
    if record.get("format") != FORMAT:
        raise ConfigError(f"pipeline checkpoint {path} is not a relaytrain pipeline checkpoint (format {FORMAT})")
    ours = manifest(cfg, record["step"])
    diffs = [f"{k}: checkpoint {v} vs config {ours['identity'][k]}"
             for k, v in record["identity"].items() if ours["identity"].get(k) != v]
    if diffs:
        raise ConfigError(f"pipeline checkpoint {path} does not fit this config ({', '.join(diffs)}); "
                          f"resume with the config it was saved with")
    if record["strategy"] != ours["strategy"]:
        raise ConfigError(f"pipeline checkpoint {path} was saved by strategy={record['strategy']} (pipe_flush keeps "
                          f"one weight version, pipe_2bw two); resume it with strategy={record['strategy']}")
    if record["layout"] != ours["layout"]:
        saved = record["layout"]
        raise ConfigError(f"pipeline checkpoint {path} holds {len(saved)} stages with blocks {saved}, this config "
                          f"splits them {ours['layout']}; resume with strategy.stages={len(saved)} "
                          f"strategy.layout=[{','.join(map(str, saved))}]")
    if record["step"] >= cfg.train.steps:
        raise ConfigError(f"pipeline checkpoint {path} is at step {record['step']}, not before "
                          f"train.steps={cfg.train.steps}; raise train.steps to train further")
    return record["step"]


def load_part(path: Path, stage: int) -> dict:
    step = json.loads((path / MANIFEST).read_text())["step"]
    file = path / part_name(stage)
    try:
        part = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign file: torch raises many kinds
        raise ConfigError(f"pipeline checkpoint part {file} cannot be read ({type(err).__name__}); it is corrupt: "
                          f"resume from an earlier checkpoint") from err
    if not isinstance(part, dict) or (part.get("format"), part.get("stage"), part.get("step")) != (FORMAT, stage, step):
        raise ConfigError(f"{file} is not stage {stage}'s part of the step-{step} checkpoint; resume from an earlier one")
    return part


# ------------------------------------------------------------------------------ RNG


def rng_state(device: torch.device) -> dict:
    """This worker's RNG streams: the CPU one, its own GPU's (not every visible GPU's: replicas
    run on different GPUs but load the same part), and Python's."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])
