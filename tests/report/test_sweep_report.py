"""A sweep ends with one table, and `relaytrain report` compares its jobs: rows, summary.csv,
plots, one metrics.csv per job, and a failed job as a row of its own."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["+exp=tiny_baseline", "train.steps=4", "train.untimed_steps=1", "data.eval_fraction=0.1"]


def relaytrain(*args: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "relaytrain.commands.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "CI": "1", "COLUMNS": "200"})
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_a_sweep_over_strategies_ends_with_one_table_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    out = relaytrain("train", "-m", *TINY, "strategy=baseline,l2l,l2l_stash_cpu", f"hydra.sweep.dir={sweep}",
                     cwd=tmp_path).stdout
    assert out.count("relaytrain report · 3 runs") == 1 and "relaytrain · baseline" not in out  # one table, not 3
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "results.json").exists())
    assert len(jobs) == 3 and all((job / "metrics.csv").is_file() for job in jobs)
    for name in ("summary.csv", "throughput_vs_memory.png", "loss_curves.png"):
        assert (sweep / name).stat().st_size > 0, name

    report = relaytrain("report", str(sweep), "--json", cwd=tmp_path).stdout
    rows = json.loads(report)
    assert sorted(r["strategy"] for r in rows) == ["baseline", "l2l", "l2l_stash_cpu"]
    assert all(r["status"] == "finished" and r["samples_per_s"] > 0 and r["final_loss"] > 0 for r in rows)
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 3
    for column in ("strategy", "model", "parameters", "precision", "samples_per_s", "tokens_per_s",
                   "model_flops_per_s", "peak_host_rss", "final_loss", "status"):
        assert column in table[0], column


@pytest.mark.slow
def test_a_job_that_fails_at_run_time_is_a_row_with_its_error(tmp_path):
    sweep = tmp_path / "sweep"
    proc = relaytrain("train", "-m", *TINY, "optim=sgd", "optim.lr=0.01,1e30", f"hydra.sweep.dir={sweep}",
                      cwd=tmp_path, ok=False)
    assert proc.returncode == 1  # the sweep went on, and says a job failed
    assert "1 sweep job(s) failed" in proc.stderr
    rows = json.loads(relaytrain("report", str(sweep), "--json", cwd=tmp_path).stdout)
    status = {r["status"]: r for r in rows}
    assert set(status) == {"finished", "failed"}
    assert "the loss became" in status["failed"]["error"]
    assert status["failed"]["optim.lr"] in ("1e30", "1e+30")
