"""scripts/bench_step_overhead.py: the model's calls it times are the step's, and what is left
of the step is small and never negative (the bench's `step_overhead_share`)."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

import pytest

from relaytrain.run.compose import compose_config
from relaytrain.run.train import run

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TINY = ["model=llama_tiny", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=172", "model.vocab_size=512", "model.dropout=0.0", "data.seq_len=32",
        "data.num_samples=64", "strategy=baseline", "strategy.microbatch_size=2", "strategy.num_microbatches=3"]


@pytest.mark.slow
def test_the_model_calls_timed_are_inside_the_measured_steps(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    bench = importlib.import_module("bench_step_overhead")
    work = bench.ModelWork()
    bench.instrument(work, monkeypatch.setattr)
    run(compose_config([*TINY, "train.steps=4", "train.untimed_steps=2", "train.check_memory=false"]), tmp_path,
        table=False, quiet=True)
    with open(tmp_path / "metrics.csv") as f:
        measured = sum(float(row["step_time_s"]) for row in list(csv.DictReader(f))[2:])
    assert all(seconds > 0 for seconds in work.seconds.values()), work.seconds
    assert sum(work.seconds.values()) < measured  # counted from the first measured step only
