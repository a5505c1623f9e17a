"""Experiment trackers (log.tensorboard, log.mlflow, log.wandb): a missing package or a stray key
is one line before any work; each tracker gets every metrics.csv column of every step exactly once,
across a resume; and, against the real packages (the `slow` step installs the mlflow and wandb
extras), an MLflow store read back with `MlflowClient` and an offline W&B run read back with
wandb's own reader of its .wandb file hold the run's config, losses and results."""

from __future__ import annotations

import importlib.machinery
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from relaytrain.commands.cli import main
from relaytrain.records import trackers
from relaytrain.records.runlog import MetricsLog, read_metrics
from relaytrain.run.compose import compose, validate
from relaytrain.run.train import run
from relaytrain.utils import failpoints
from relaytrain.utils.errors import ConfigError
from tests.conftest import TINY, tiny_cfg, wait_for


@pytest.mark.parametrize("key, module", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")])
def test_a_tracker_without_its_package_is_refused_in_one_line_before_any_work(key, module, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    run_dir = tmp_path / "run"
    assert main(["train", "+exp=tiny_baseline", f"log.{key}=true", f"hydra.run.dir={run_dir}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"relaytrain: error: log.{key}=true needs the {module} package: pip install 'relaytrain[{module}]' "
        f"(or pip install {module}), or set log.{key}=false"]
    assert not run_dir.exists()  # refused before Hydra made the run directory


@pytest.mark.parametrize("key, tracker", [("mlflow_uri=sqlite:///x.db", "mlflow"), ("wandb_project=p", "wandb")])
def test_a_trackers_key_without_the_tracker_is_refused(key, tracker, tmp_path, capsys):
    assert main(["train", "+exp=tiny_baseline", f"log.{key}", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    name = key.split("=")[0]
    assert capsys.readouterr().err.strip().splitlines() == [
        f"relaytrain: error: log.{name} is set but log.{tracker}=false; add log.{tracker}=true (or drop log.{name})"]


def test_an_mlflow_server_that_does_not_answer_is_refused_before_any_work(monkeypatch):
    installed = types.ModuleType("mlflow")  # installed or not here: the server is what is checked
    installed.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow", installed)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{probe.getsockname()[1]}"
    log = compose(["log.mlflow=true", f"log.mlflow_uri={uri}"]).log
    with pytest.raises(ConfigError, match=rf"^log.mlflow: no MLflow server answers at {uri} \(.*refused.*\); start it"):
        trackers.check_trackers(log)


def test_a_dry_run_refuses_the_trackers():
    with pytest.raises(ConfigError, match=r"drop log\.mlflow=true, log\.wandb=true$"):
        validate(compose(["train.device=meta", "log.mlflow=true", "log.wandb=true"]))


class Recorder(trackers.Tracker):
    """A tracker that keeps what it is given."""

    def __init__(self, continued: bool):
        self.continued, self.steps, self.results, self.outcome = continued, [], None, None

    def log_step(self, step, figures):
        self.steps.append((step, figures["loss"]))

    def log_final(self, step, figures):
        self.results = (step, figures)

    def close(self, outcome):
        self.outcome = outcome


def write_rows(log: MetricsLog, steps) -> None:
    for step in steps:
        log.write({"step": step, "loss": 1.0 / step, "lr": 0.1, "eval_loss": None})


def test_metrics_log_hands_each_step_to_each_tracker_once_across_a_resume(tmp_path):
    first = Recorder(continued=False)
    log = MetricsLog(tmp_path, 0, [first])
    write_rows(log, [1, 2, 3, 4])  # then killed; its checkpoint is at step 2
    log.close("failed")
    assert first.steps == [(s, 1.0 / s) for s in (1, 2, 3, 4)] and first.outcome == "failed" and first.results is None

    continued, new = Recorder(continued=True), Recorder(continued=False)
    log = MetricsLog(tmp_path, 2, [continued, new])
    write_rows(log, [3, 4, 5])
    log.close("finished", {"steps": 5, "loss": [0.5], "throughput": {"samples_per_s": 12.5}})
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert [s for s, _ in continued.steps] == [5]  # it holds 1-4 from the first attempt
    assert [s for s, _ in new.steps] == [1, 2, 3, 4, 5]  # the kept rows first
    assert continued.results == (5, {"results/steps": 5.0, "results/throughput.samples_per_s": 12.5})


def test_final_figures_are_results_numbers_under_names_every_tracker_accepts():
    results = {"steps": 3, "strategy": "baseline", "loss": [0.7, 0.6], "model": {"parameters": 100, "pretrained": None},
               "eval": [{"step": 1, "loss": 0.9}, {"step": 3, "loss": 0.8, "accuracy": 0.5}],
               "strategy_report": {"phase_times_s": {"forward+backward": 1.5}}, "skipped": False}
    assert trackers.final_figures(results) == {
        "results/steps": 3.0, "results/model.parameters": 100.0, "results/eval.step": 3.0, "results/eval.loss": 0.8,
        "results/eval.accuracy": 0.5, "results/strategy_report.phase_times_s.forward_backward": 1.5}


def test_wandb_is_offline_unless_a_project_and_a_key_are_known(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no login on this machine
    said = []
    assert trackers.wandb_mode(None, said.append) == "offline" and said == []
    assert trackers.wandb_mode("proj", said.append) == "offline"
    assert said == ["wandb: log.wandb_project=proj but no W&B API key is known (WANDB_API_KEY, or `wandb login`): "
                    "logging offline; upload the run later with `wandb sync`"]
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password key\n")
    assert trackers.wandb_mode("proj", said.append) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert trackers.wandb_mode("proj", said.append) is None  # the user's own choice: wandb reads it


# ----------------------------------------------------------------------- the real packages


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No tracker reaches the network or the user's own settings."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_ERROR_REPORTING", "false"),
                        ("WANDB_CONFIG_DIR", tmp_path / "wandb-config"), ("WANDB_CACHE_DIR", tmp_path / "wandb-cache"),
                        ("WANDB_DATA_DIR", tmp_path / "wandb-data")):
        monkeypatch.setenv(name, str(value))
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # its service process, started by the run


def mlflow_run(run_dir: Path):
    """The run trackers.json names, and its client."""
    from mlflow import MlflowClient

    saved = json.loads((run_dir / trackers.TRACKERS_FILE).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=saved["uri"])
    return client, client.get_run(saved["run_id"])


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of every offline run in run_dir/wandb, read by wandb's own reader (`wandb leet inspect`)."""
    records = []
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, check=True, timeout=120).stdout
        records += [json.loads(line) for line in out.splitlines() if line.strip()]
    return records


@pytest.mark.slow
def test_an_mlflow_store_holds_the_config_every_step_and_the_results(tmp_path, offline):
    pytest.importorskip("mlflow")
    results = run(tiny_cfg("bert", "train.steps=3", "data.eval_fraction=0.1", "log.mlflow=true"), tmp_path)
    assert (tmp_path / "mlruns" / "mlflow.db").is_file()  # the default store, inside the run directory
    client, found = mlflow_run(tmp_path)
    assert found.info.status == "FINISHED" and found.info.run_name == tmp_path.name
    assert found.data.params["model.hidden_size"] == "32" and found.data.params["strategy.name"] == "baseline"
    rows = read_metrics(tmp_path)
    for column in ("loss", "lr", "step_time_s", "samples_per_s", "host_rss_bytes", "eval_loss", "eval_accuracy"):
        assert history(client, found.info.run_id, column) == [(int(r["step"]), r[column]) for r in rows
                                                             if r[column] is not None], column
    assert [v for _, v in history(client, found.info.run_id, "loss")] == results["loss"]
    final = found.data.metrics
    assert final["results/throughput.samples_per_s"] == results["throughput"]["samples_per_s"]
    assert final["results/eval.accuracy"] == results["eval"][-1]["accuracy"]


@pytest.mark.slow
def test_an_offline_wandb_run_holds_the_config_every_step_and_the_results(tmp_path, offline, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE")  # relaytrain's own choice: offline, no project was given
    results = run(tiny_cfg("bert", "train.steps=3", "log.wandb=true"), tmp_path)
    records = wandb_records(tmp_path)
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["model"]["hidden_size"] == 32 and config["strategy"]["name"] == "baseline"
    steps = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"]["num"] for h in steps] == [1, 2, 3]
    rows = read_metrics(tmp_path)
    for column in ("loss", "lr", "step_time_s", "samples_per_s"):
        assert [h["item"][column] for h in steps] == [r[column] for r in rows], column
    assert [h["item"]["loss"] for h in steps] == results["loss"]
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    assert summary["results/throughput.samples_per_s"] == results["throughput"]["samples_per_s"]


def killed_at_step(run_dir: Path, step: int, *overrides: str) -> None:
    """`relaytrain train` in its own process, killed (SIGKILL) as it is about to run `step`."""
    marks = run_dir.parent / "marks"
    marks.mkdir()
    env = {**os.environ, failpoints.VARIABLE: f"step:{step}=hold", failpoints.MARKS: str(marks)}
    proc = subprocess.Popen([sys.executable, "-m", "relaytrain.commands.cli", "train", *TINY["bert"], *overrides,
                             f"hydra.run.dir={run_dir}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(marks / f"step-{step}-0", proc)
    proc.kill()
    proc.wait(timeout=60)


@pytest.mark.slow
def test_a_killed_run_resumed_continues_its_mlflow_and_wandb_runs_without_a_step_twice(tmp_path, offline):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    both = ("train.untimed_steps=1", "train.checkpoint_every=1", "log.mlflow=true", "log.wandb=true")
    killed_at_step(run_dir, 4, "train.steps=5", *both)  # steps 1-3 logged everywhere
    first = json.loads((run_dir / trackers.TRACKERS_FILE).read_text())
    step_2 = run_dir / "checkpoints" / "step-00000002"  # behind what metrics.csv and the trackers hold
    results = run(tiny_cfg("bert", "train.steps=6", *both, f"train.resume={step_2}"), run_dir)
    assert json.loads((run_dir / trackers.TRACKERS_FILE).read_text()) == first  # the same runs, continued
    rows = read_metrics(run_dir)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == results["loss"]

    client, found = mlflow_run(run_dir)
    assert history(client, found.info.run_id, "loss") == [(int(r["step"]), r["loss"]) for r in rows]
    assert found.info.status == "FINISHED" and found.data.metrics["results/steps"] == 6
    assert found.data.params["train.steps"] == "5" and found.data.tags["resumed/train.steps"] == "6"

    # W&B writes an offline run's file every 15 s (and at its end): the killed attempt's steps
    # may be lost there, never sent twice.
    records = wandb_records(run_dir)
    assert {r["run"]["run_id"] for r in records if r["type"] == "run"} == {first["wandb"]["id"]}
    logged = [(r["history"]["step"]["num"], r["history"]["item"]["loss"]) for r in records if r["type"] == "history"]
    assert len({step for step, _ in logged}) == len(logged)
    assert set(logged) <= {(int(r["step"]), r["loss"]) for r in rows}
    assert {4, 5, 6} <= {step for step, _ in logged}
