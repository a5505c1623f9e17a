"""What `relaytrain report` reads: a run directory as one row.

Each run directory gives one row, read from what the run left there (`results.json`, and
`status.json`, `metrics.csv`, `.hydra/` from `runlog` and Hydra), so a failed or interrupted job
is a row with its status and error rather than a gap.

Also the helpers the table, the plots and summary.csv share: short run labels, a swept key's
short name, and a cell as a number or as text.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from relaytrain.records import runlog
from relaytrain.step.evaluation import METRICS
from relaytrain.utils.errors import ConfigError

COLUMNS = [
    "run", "status", "strategy", "model", "parameters", "microbatch_size", "num_microbatches", "replicas",
    "samples_per_step", "precision", "processes", "device", "steps", "samples_per_s", "tokens_per_s",
    "model_flops_per_s", "step_time_s", "peak_device_memory", "device_memory_simulated", "peak_host_rss",
    "host_rss_total", "final_loss", "eval_step", *(f"eval_{name}" for name in METRICS), "error", "path",
]
GIB = 2**30
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_HYDRA_JOB = re.compile(r"(\d+)_.*=.*")  # hydra.sweep.subdir: ${hydra.job.num}_${hydra.job.override_dirname}


@dataclass
class Run:
    """One run directory as read: its row (a summary.csv record), its loss curve and its overrides."""

    path: Path
    row: dict
    losses: list[tuple[float, float]]
    overrides: dict[str, str]
    label: str = ""  # the short name the table and the plots show


def swept_keys(overrides: list[dict[str, str]]) -> list[str]:
    """The override keys whose values differ between runs (a key some runs lack differs too), in the
    order they first appear: what a sweep varied, whatever the runs' directory names say."""
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    return [k for k in keys if len({o.get(k) for o in overrides}) > 1]


# ----------------------------------------------------------------------------- reading runs


def is_run_dir(path: Path) -> bool:
    return (path / "results.json").is_file() or (path / runlog.STATUS).is_file()


def run_dirs(paths: list[Path]) -> list[Path]:
    """Each path's run directories, each once: the path itself, or a sweep's jobs in job order."""
    found = []
    for path in paths:
        if not path.is_dir():
            raise ConfigError(f"{path} is not a directory; give a run directory or a sweep directory "
                              f"(e.g. multirun/DATE/TIME)")
        jobs = [path] if is_run_dir(path) else sorted(
            (d for d in path.iterdir() if d.is_dir() and is_run_dir(d)), key=lambda d: natural_key(d.name))
        if not jobs:
            raise ConfigError(f"{path} holds no run: neither it nor a directory directly inside it has "
                              "results.json or status.json; give a run or a sweep (multirun/DATE/TIME) "
                              "directory")
        found += [job.resolve() for job in jobs]
    return list(dict.fromkeys(found))


def read_run(path: Path) -> Run:
    results = _read_json(path / "results.json")
    status = runlog.read_status(path) or {}
    metrics = runlog.read_metrics(path)
    row = dict.fromkeys(COLUMNS)
    row.update(run=path.name, path=str(path), error=status.get("error"),
               status=status.get("status") or (runlog.FINISHED if results else "unknown"))
    row.update(_from_results(results) if results else _from_config(path, status, metrics))
    losses = _loss_curve(results, metrics)
    row["final_loss"] = losses[-1][1] if losses else None
    row.update(_last_eval(results, metrics))
    return Run(path, row, losses, _overrides(path, results))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _from_results(results: dict) -> dict:
    model, t, memory = results["model"], results["throughput"], results["memory"]
    device = memory["device"]
    return {
        "strategy": results["strategy"], "model": model["name"], "parameters": model["parameters"],
        "microbatch_size": results["microbatch_size"], "num_microbatches": results["num_microbatches"],
        "replicas": results.get("replicas", 1), "samples_per_step": results["samples_per_step"],
        "precision": results["precision"], "processes": results["processes"], "device": results["device"],
        "steps": results["steps"], "samples_per_s": t["samples_per_s"], "tokens_per_s": t["tokens_per_s"],
        "model_flops_per_s": t["model_flops_per_s"], "step_time_s": t["step_time_s"],
        "peak_device_memory": device["peak_allocated_bytes"],
        "device_memory_simulated": bool(device.get("simulated")),
        "peak_host_rss": memory["host_peak_rss_bytes"],
        "host_rss_total": memory.get("host_peak_rss_total_bytes"),
    }


def _from_config(path: Path, status: dict, metrics: list[dict]) -> dict:
    """A run without results.json (failed, interrupted, running) still names its strategy, model and
    batch, from the config Hydra saved, so it groups and filters with the others."""
    try:
        cfg = yaml.safe_load((path / ".hydra" / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    strategy = cfg.get("strategy") or {}
    last_step = metrics[-1]["step"] if metrics and metrics[-1]["step"] is not None else None
    return {
        "strategy": strategy.get("name"),
        "model": (cfg.get("model") or {}).get("name"),
        "precision": (cfg.get("precision") or {}).get("name"),
        "microbatch_size": strategy.get("microbatch_size"),
        "num_microbatches": strategy.get("num_microbatches"),
        "replicas": strategy.get("replicas", 1 if strategy else None),  # a strategy without the key has one
        "steps": status.get("step", int(last_step) if last_step is not None else None),
    }


def _loss_curve(results: dict | None, metrics: list[dict]) -> list[tuple[float, float]]:
    """(step, loss) pairs: metrics.csv has the steps (a resumed run's too); results.json only the losses."""
    if metrics:
        return [(m["step"], m["loss"]) for m in metrics if m["step"] is not None and m["loss"] is not None]
    return [(float(step), loss) for step, loss in enumerate((results or {}).get("loss", []), start=1)]


def _last_eval(results: dict | None, metrics: list[dict]) -> dict:
    evals = (results or {}).get("eval") or [
        {"step": m["step"], **{k: m.get(f"eval_{k}") for k in METRICS}}
        for m in metrics if m.get("eval_loss") is not None]
    if not evals:
        return {}
    last = evals[-1]
    return {"eval_step": int(last["step"]), **{f"eval_{k}": last.get(k) for k in METRICS}}


def _overrides(path: Path, results: dict | None) -> dict[str, str]:
    """The overrides as typed (results.json's, else Hydra's record of them), key to value text; a
    `+`/`~` prefix only says how Hydra applied the key, so it is dropped."""
    typed = (results or {}).get("overrides")
    if typed is None:
        try:
            typed = yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text()) or []
        except (OSError, yaml.YAMLError):
            typed = []
    pairs = (str(o).partition("=") for o in typed)
    return {key.lstrip("+~"): value for key, eq, value in pairs if eq}


# ----------------------------------------------------------------------------- labels and cells


def run_labels(paths: list[Path]) -> list[str]:
    """Short run names: each path below the directory all runs share, and a Hydra job
    (`N_key=value,...`, named by every override) by its number N: its swept values get columns."""
    root = common_root(paths)
    labels = []
    for path in paths:
        relative = path.relative_to(root)
        job = _HYDRA_JOB.fullmatch(relative.name)
        labels.append((relative.parent / job.group(1) if job else relative).as_posix())
    return labels


def common_root(paths: list[Path]) -> Path | None:
    return Path(os.path.commonpath([p.parent for p in paths])) if paths else None


def shown_path(path: Path) -> str:
    """A path short enough to read: relative to the current directory when below it."""
    relative = os.path.relpath(Path(path).resolve(), Path.cwd())
    return str(Path(path).resolve()) if relative == "." or relative.startswith("..") else relative


def short_key(key: str) -> str:
    """A swept key as headers and legends show it: strategy.num_microbatches as num_microbatches."""
    return key.rpartition(".")[2]


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each key by its `short_key`, or whole where two share it (model.dropout, adapter.dropout)."""
    counts = Counter(map(short_key, keys))
    return {k: short_key(k) if counts[short_key(k)] == 1 else k for k in keys}


def numeric_key(runs: list[Run], key: str) -> bool:
    """Whether every run that sets this override gives it a number (a swept size, rather than a choice)."""
    values = [r.overrides[key] for r in runs if key in r.overrides]
    return bool(values) and all(to_number(v) is not None for v in values)


def natural_key(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def to_number(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return float(value) if _NUMBER.fullmatch(str(value).strip()) else None


def cell_text(value) -> str:
    """A cell as summary.csv writes it and --filter compares it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
