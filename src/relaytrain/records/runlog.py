"""What a run leaves in its directory while it runs, so that a run killed at any point still
tells what it did:

    RUN_DIR/status.json   running | finished | failed | interrupted, the error line, the step reached
    RUN_DIR/metrics.csv   one row per step, flushed as it goes (COLUMNS)

and hands each row to the run's experiment trackers (`relaytrain.records.trackers`: TensorBoard, MLflow,
W&B, as log.* asks). Only the reporting process writes them (a pipeline logs from one place, not
once per worker). `relaytrain report` reads them, with results.json, to compare runs.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Sequence
from pathlib import Path

from relaytrain.objectives.kto import FIGURES as KTO_FIGURES
from relaytrain.objectives.preference import FIGURES as PREFERENCE_FIGURES
from relaytrain.objectives.reference_free import ORPO_FIGURES
from relaytrain.objectives.reward import FIGURES as REWARD_FIGURES
from relaytrain.step.evaluation import METRICS as EVAL_METRICS
from relaytrain.utils.files import write_json

STATUS = "status.json"
METRICS = "metrics.csv"
# The terms a model reports beside its loss (`Strategy.loss_terms`: a mixture's router term, a
# preference objective's rewards and log-probs, a reward model's scores, in TRL's names),
# empty in a row of a model without them.
LOSS_TERMS = tuple(dict.fromkeys(("router_aux", *PREFERENCE_FIGURES, *KTO_FIGURES, *ORPO_FIGURES, *REWARD_FIGURES)))  # shared names once
COLUMNS = [
    "step", "loss", *LOSS_TERMS, "lr", "step_time_s", "samples_per_s", "tokens_per_s", "host_rss_bytes", "device_allocated_bytes",
    *(f"eval_{name}" for name in EVAL_METRICS), "eval_items",
]
RUNNING, FINISHED, FAILED, INTERRUPTED = "running", "finished", "failed", "interrupted"


def columns(extra: Sequence[str] = ()) -> list[str]:
    """metrics.csv's columns: COLUMNS, with a run's own figures (`extra`: an online objective's
    rewards, named by the run's reward functions) after the loss terms."""
    added = [name for name in dict.fromkeys(extra) if name not in COLUMNS]
    at = COLUMNS.index("lr")
    return [*COLUMNS[:at], *added, *COLUMNS[at:]]


def write_status(run_dir: Path, status: str, **fields) -> None:
    """status.json, replaced atomically: a reader never sees half of it. An error is this
    write's own: one an earlier attempt ended with (a SIGINT, then a resume) does not stay."""
    previous = {k: v for k, v in (read_status(run_dir) or {}).items() if k != "error"}
    record = {**previous, **fields, "status": status, "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if status == RUNNING and "started_at" not in fields:
        record.setdefault("started_at", record["updated_at"])
    write_json(Path(run_dir) / STATUS, record)


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS).read_text())
    except (OSError, ValueError):
        return None


def finished_steps(run_dir: Path) -> int | None:
    """The steps the run in `run_dir` finished (status.json says so and results.json is there);
    None for a run that has not finished."""
    status = read_status(run_dir) or {}
    if status.get("status") != FINISHED or not (Path(run_dir) / "results.json").is_file():
        return None
    return status.get("step")


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.csv's rows, numbers as floats (empty cells as None); [] when there is none."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()} for row in csv.DictReader(f)]


class MetricsLog:
    """Appends one row per step to metrics.csv (flushed, so a killed run keeps its history) and
    hands the same figures to each of `trackers` (`relaytrain.records.trackers.Tracker`).

    A resumed run (`resume_from_step` > 0) keeps the rows up to its checkpoint. A tracker that
    continues its earlier run already holds every step the earlier attempt wrote, so it gets only
    the steps after those (never a step twice); a tracker new to the run gets the kept rows first.
    """

    def __init__(self, run_dir: Path, resume_from_step: int = 0, trackers: Sequence = (), extra: Sequence[str] = ()):
        path = Path(run_dir) / METRICS
        self._columns = columns(extra)
        earlier = [row for row in read_metrics(run_dir) if row["step"] is not None] if resume_from_step else []
        kept = [row for row in earlier if row["step"] <= resume_from_step]
        self._file = open(path, "w", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=self._columns)
        self._csv.writeheader()
        for row in kept:
            self._csv.writerow({k: _cell(row.get(k)) for k in self._columns})
        self._file.flush()
        self._trackers = list(trackers)
        logged = max((row["step"] for row in earlier), default=0)
        self._logged = [logged if tracker.continued else 0 for tracker in self._trackers]  # each one's last step
        for row in kept:
            self._track(row)

    def write(self, row: dict) -> None:
        self._csv.writerow({k: _cell(row.get(k)) for k in self._columns})
        self._file.flush()
        self._track(row)

    def _track(self, row: dict) -> None:
        step = int(row["step"])
        figures = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, int | float)}
        for tracker, logged in zip(self._trackers, self._logged, strict=True):
            if step > logged:
                tracker.log_step(step, figures)

    def close(self, outcome: str = FINISHED, results: dict | None = None) -> None:
        """Close metrics.csv; end each tracker's run as `outcome`, with the run's `results` when it finished."""
        self._file.close()
        for tracker in self._trackers:
            if results:
                tracker.log_results(results)
            tracker.close(outcome)


def _cell(value):
    if value is None:
        return ""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value
