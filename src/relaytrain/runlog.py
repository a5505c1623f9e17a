"""What a run leaves in its directory while it runs, so that a run killed at any point still
tells what it did:

    RUN_DIR/status.json   running | finished | failed | interrupted, the error line, the step reached
    RUN_DIR/metrics.csv   one row per step, flushed as it goes (COLUMNS)
    RUN_DIR/tensorboard/  the same figures as TensorBoard events, with log.tensorboard=true

Only the reporting process writes them (a pipeline logs from one place, not once per worker).
`relaytrain report` reads them, with results.json, to compare runs.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from relaytrain.errors import ConfigError
from relaytrain.evaluation import METRICS as EVAL_METRICS
from relaytrain.files import write_json

STATUS = "status.json"
METRICS = "metrics.csv"
# The terms a model reports beside its loss (`Strategy.loss_terms`: a mixture's router term),
# empty in a row of a model without them.
LOSS_TERMS = ("router_aux",)
COLUMNS = [
    "step", "loss", *LOSS_TERMS, "lr", "step_time_s", "samples_per_s", "tokens_per_s", "host_rss_bytes", "device_allocated_bytes",
    *(f"eval_{name}" for name in EVAL_METRICS), "eval_items",
]
RUNNING, FINISHED, FAILED, INTERRUPTED = "running", "finished", "failed", "interrupted"


def write_status(run_dir: Path, status: str, **fields) -> None:
    """status.json, replaced atomically: a reader never sees half of it."""
    previous = read_status(run_dir) or {}
    record = {**previous, **fields, "status": status, "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if status == RUNNING and "started_at" not in fields:
        record.setdefault("started_at", record["updated_at"])
    write_json(Path(run_dir) / STATUS, record)


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS).read_text())
    except (OSError, ValueError):
        return None


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.csv's rows, numbers as floats (empty cells as None); [] when there is none."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()} for row in csv.DictReader(f)]


class MetricsLog:
    """Appends one row per step to metrics.csv (flushed, so a killed run keeps its history) and,
    with `tensorboard`, writes the same figures as TensorBoard scalars under RUN_DIR/tensorboard."""

    def __init__(self, run_dir: Path, resume_from_step: int = 0, tensorboard: bool = False):
        path = Path(run_dir) / METRICS
        kept = [row for row in read_metrics(run_dir) if row["step"] is not None and row["step"] <= resume_from_step]
        self._file = open(path, "w", newline="")  # a resumed run keeps the rows up to its checkpoint
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._csv.writeheader()
        for row in kept:
            self._csv.writerow({k: _cell(row.get(k)) for k in COLUMNS})
        self._file.flush()
        self._events = _tensorboard_writer(Path(run_dir) / "tensorboard") if tensorboard else None

    def write(self, row: dict) -> None:
        self._csv.writerow({k: _cell(row.get(k)) for k in COLUMNS})
        self._file.flush()
        if self._events is not None:
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._events.add_scalar(key.replace("eval_", "eval/"), value, step)
            self._events.flush()

    def close(self) -> None:
        self._file.close()
        if self._events is not None:
            self._events.close()


def _cell(value):
    if value is None:
        return ""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


def _tensorboard_writer(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ConfigError("log.tensorboard=true needs the tensorboard package: pip install 'relaytrain[tensorboard]' "
                          "(or pip install tensorboard), or set log.tensorboard=false") from err
    return SummaryWriter(str(directory))
