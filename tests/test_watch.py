"""Watching and stopping a run: metrics.csv as it trains, TensorBoard events, progress inside
long steps, help for every key, and Ctrl-C answered at once the second time. That every
strategy's phase times sum to no more than the step time beside them is a property of every
conformance cell (tests/conformance/)."""

import csv
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from relaytrain.commands.cli import main
from relaytrain.records import checkpoint
from relaytrain.records.display import StepProgress
from relaytrain.records.runlog import COLUMNS, read_metrics, read_status
from relaytrain.run.compose import compose as checked_config
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.schema.config import field_docs
from relaytrain.strategies import registry
from tests.conftest import tiny_cfg, wait_for


def test_every_key_of_every_strategy_and_optimizer_has_a_description():
    from relaytrain.schema.config import RelayTrainConfig
    from relaytrain.step.optim import optimizer_schemas

    schemas = [f.default_factory for f in fields(RelayTrainConfig) if f.name not in ("strategy", "optim")]
    schemas += [cls.Config for cls in registry().values()] + list(optimizer_schemas().values())
    for schema in schemas:
        docs = field_docs(schema)
        missing = [f.name for f in fields(schema) if not docs.get(f.name)]
        assert not missing, f"{schema.__name__}: {missing}"


def test_train_help_lists_each_key_with_its_description(capsys):
    assert main(["train", "strategy=l2l", "--help"]) == 0
    out = capsys.readouterr().out
    assert "strategy.max_resident_blocks = 2" in out and "parts on the device at once" in out
    assert "strategy.eps_state = sharded" in out and "[replicated|sharded]" in out
    assert "strategy.stages" not in out  # not a key of l2l
    cfg = checked_config(["strategy=l2l"])
    assert all(f"strategy.{key} = " in out for key in cfg.strategy)
    assert "log.tensorboard = False" in out


def test_metrics_csv_is_written_as_the_run_trains(tmp_path):
    cfg = tiny_cfg("bert", "train.steps=6", "data.eval_fraction=0.1", "eval.every=3")
    results = run(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == pytest.approx(results["loss"])
    assert all(r["samples_per_s"] > 0 and r["host_rss_bytes"] > 0 and r["lr"] > 0 for r in rows)
    assert [r["eval_accuracy"] is not None for r in rows] == [False, False, True, False, False, True]
    assert rows[2]["eval_loss"] == pytest.approx(results["eval"][0]["loss"])
    with open(tmp_path / "metrics.csv") as f:
        assert next(csv.reader(f)) == COLUMNS
    assert read_status(tmp_path)["status"] == "finished"


def test_a_pipeline_logs_from_one_place(tmp_path):
    run(tiny_cfg("gpt2", "strategy=pipe_2bw", "train.steps=4", "strategy.num_microbatches=2"), tmp_path)
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_tensorboard_events_with_log_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tiny_cfg("bert", "train.steps=3", "log.tensorboard=true"), tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert "samples_per_s" in events.Tags()["scalars"]


def test_the_estimate_and_progress_inside_long_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(StepProgress, "QUIET_S", 0.0)  # a line for every move inside a step
    monkeypatch.setenv("CI", "1")
    assert main(["train", "+exp=tiny_l2l", "train.steps=2", "train.untimed_steps=0", f"hydra.run.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("estimate (a prediction): about ")
    assert "step 1/2: forward: block 2/4" in out and "step 1/2: backward: embeddings" in out
    assert "s last step  ETA " in out


@pytest.mark.slow  # about 10 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_config_meant_for_a_gpu_says_so_before_it_starts():
    from relaytrain.planner.estimate import estimate
    from relaytrain.strategies import strategy_class

    cpu = torch.device("cpu")
    line = estimate(compose_config(["+exp=bert_large_l2l"]), strategy_class("l2l")).line(30, cpu)
    assert line.startswith("estimate (a prediction): about ")
    assert "this config is meant for a GPU: to try it on this CPU, shorten it" in line


# The run under test, with its second step held open until the run is aborted: the baseline's
# step marks where it is (inside step 2; the first signal seen) and waits, so nothing depends on
# how fast the machine is. Waiting on an Event is interruptible: the second signal's handler
# raises there, as it would in any long step.
HELD_RUN = """
import sys, threading
from pathlib import Path
from relaytrain.commands.cli import main
from relaytrain.strategies.baseline import Baseline

marks, steps = Path(sys.argv[1]), []
plain_step = Baseline.step

def held_step(self, minibatch, lr):
    steps.append(None)
    if len(steps) < 2:
        return plain_step(self, minibatch, lr)
    (marks / "inside").touch()
    while not self.world.stop.signum:
        threading.Event().wait(0.01)
    (marks / "asked").touch()
    threading.Event().wait()

Baseline.step = held_step
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_two_sigints_end_a_long_step_at_once_naming_the_latest_checkpoint(tmp_path):
    """The first SIGINT asks to stop after the step in flight, the second ends the run at once;
    the newest complete checkpoint is named, and it loads."""
    args = ["train", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
            "model.intermediate_size=128", "data.seq_len=32", "strategy.microbatch_size=4",
            "strategy.num_microbatches=2", "train.steps=50", "train.untimed_steps=1", "train.checkpoint_every=1",
            f"hydra.run.dir={tmp_path / 'run'}"]
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HELD_RUN, str(marks), *args], env={**os.environ, "CI": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(marks / "inside", proc)  # step 2 is in flight, and stays so
    proc.send_signal(signal.SIGINT)
    wait_for(marks / "asked", proc)  # the first signal was taken
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    # The step is held for ever: ending at all is ending at once; the bound only keeps a hang finite.
    assert time.monotonic() - sent < 50, "the second SIGINT did not end the run at once"
    assert proc.returncode == 128 + signal.SIGINT
    tmp_path = tmp_path / "run"
    latest = checkpoint.latest(tmp_path)
    lines = err.strip().splitlines()
    assert "SIGINT: stopping after the step in flight" in lines[0] and "send it again to stop at once" in lines[0]
    assert lines[-1] == (f"relaytrain: SIGINT again: stopped at once; the latest complete checkpoint is {latest}; "
                         f"continue with train.resume={latest}")
    cfg = compose_config(args[1:-1])
    assert checkpoint.read(latest, checkpoint.identity(cfg), cfg.train.steps, "baseline",
                           {"processes": 1}).trainer()["step"] >= 1
    assert read_status(tmp_path)["status"] == "interrupted"
    assert not list(Path(checkpoint.checkpoint_dir(tmp_path)).glob("*.parts"))  # nothing half-published


def test_a_run_stopped_by_ctrl_c_says_in_status_json_the_step_its_checkpoint_holds(tmp_path, monkeypatch):
    """status.json of a stopped run names the step the stop saved (a watcher reads how far it got)."""
    from relaytrain.run import train
    from relaytrain.utils.errors import Interrupted

    saved = tmp_path / "checkpoints" / "step-00000056"

    def stopped(*args, **kwargs):
        raise Interrupted(signal.SIGINT, 56, saved)

    monkeypatch.setattr(train, "_run", stopped)
    with pytest.raises(Interrupted):
        run(tiny_cfg(), tmp_path, table=False)
    status = read_status(tmp_path)
    assert status["status"] == "interrupted" and status["step"] == 56 and "SIGINT at step 56" in status["error"]
