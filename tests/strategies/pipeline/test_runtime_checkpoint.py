"""Pipeline checkpoints: killed or stopped runs resume to the uninterrupted run's weights and
losses bit for bit; incomplete checkpoints are ignored, mismatched ones refused, NaN stops.

Every run is the real CLI with real gloo workers (2 stages, dropout on, so the RNG streams
matter), launched in its own process group so a SIGKILL of the group takes the workers too.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.commands.cli import main
from relaytrain.records import checkpoint
from relaytrain.records.checkpoint import checkpoint_dir
from relaytrain.strategies.pipeline.schedule import Op, build_schedule, schedules, stop_points
from relaytrain.strategies.pipeline.validate import check_schedule
from relaytrain.utils.errors import ConfigError
from tests.conftest import wait_for

TINY = ["model.num_layers=3", "model.hidden_size=32", "model.num_heads=4", "model.intermediate_size=64",
        "model.vocab_size=300", "model.dropout=0.1", "data.seq_len=16", "data.num_samples=256"]
# About 10 ms a step on 2 cores: 60 steps leave time to kill a run between two checkpoints.
COMMON = ["train", *TINY, "train.steps=60", "train.untimed_steps=1", "train.log_every=10", "train.save_model=true",
          "strategy.microbatch_size=2", "strategy.num_microbatches=4"]
RUN = [*COMMON, "strategy.stages=2", "strategy.timeout_s=60"]
FLUSH = ["model=bert_tiny", "strategy=pipe_flush"]
TWO_BW = ["model=gpt2_tiny", "strategy=pipe_2bw"]  # GPT-2: the tied wte/lm_head sit on both stages


def start(run_dir: Path, *extra: str, run: list[str] = RUN) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relaytrain.commands.cli", *run, *extra, f"hydra.run.dir={run_dir}"],
                            env={**os.environ, "CI": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(run_dir: Path, *extra: str, run: list[str] = RUN) -> str:
    proc = start(run_dir, *extra, run=run)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers, mid-step
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Every loss and every saved weight equal, bit for bit."""
    losses = json.loads((run_dir / "results.json").read_text())["loss"]
    assert losses == json.loads((reference / "results.json").read_text())["loss"]
    ours, theirs = (load_file(d / "model" / "model.safetensors") for d in (run_dir, reference))
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def steps_of(directory: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in checkpoint.list_checkpoints(directory)]


@pytest.fixture(scope="module")
def flush_reference(tmp_path_factory) -> Path:
    # Checkpoints every 20 steps: the refusal tests resume from them.
    run_dir = tmp_path_factory.mktemp("flush")
    finish(run_dir, *FLUSH, "train.checkpoint_every=20")
    return run_dir


@pytest.fixture(scope="module")
def two_bw_reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("2bw")
    finish(run_dir, *TWO_BW)
    return run_dir


# ------------------------------------------------------------------------------ resume


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_flush_killed_resumes_exactly_past_an_incomplete_checkpoint(flush_reference, tmp_path):
    run_dir, every = tmp_path / "run", ["train.checkpoint_every=8", "train.resume=auto"]
    proc = start(run_dir, *FLUSH, *every)
    wait_for(checkpoint_dir(run_dir) / "step-00000016", proc)
    kill_group(proc)
    assert not (run_dir / "results.json").exists()  # it really stopped early
    *earlier, latest = checkpoint.list_checkpoints(checkpoint_dir(run_dir))
    (latest / "part-1.pt").unlink()  # as if the last stage never finished writing

    out = finish(run_dir, *FLUSH, *every)
    assert f"resuming from step {int(earlier[-1].name[5:])} of {earlier[-1]}\n" in out
    assert_same_run(run_dir, flush_reference)


@pytest.mark.slow  # as the fault matrix's kill rows (tests/test_faults.py), which run in the same step
def test_2bw_killed_resumes_exactly_with_both_weight_versions(two_bw_reference, tmp_path):
    # From step 21: at an odd step the newest weight version sits in the second buffer.
    run_dir, every = tmp_path / "run", ["train.checkpoint_every=7", "train.resume=auto"]
    proc = start(run_dir, *TWO_BW, *every)
    odd = checkpoint_dir(run_dir) / "step-00000021"
    wait_for(odd, proc)
    kill_group(proc)
    assert not (run_dir / "results.json").exists()
    for later in checkpoint.list_checkpoints(checkpoint_dir(run_dir)):
        if later.name > odd.name:  # saved before the kill landed: as if it had landed sooner
            shutil.rmtree(later)

    out = finish(run_dir, *TWO_BW, *every)
    assert f"resuming from step 21 of {odd}\n" in out
    assert_same_run(run_dir, two_bw_reference)


# message-driven stops by the same votes; its variant runs in make test-slow (the suite keeps to 15 min)
@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
@pytest.mark.parametrize("execution", ["static", "message_driven"])
def test_sigterm_to_the_launcher_stops_every_worker_at_one_step_and_saves(two_bw_reference, tmp_path, execution):
    # No periodic checkpoints: the workers agree on the step to stop at while the pipeline runs.
    # Message-driven execution reorders only within a step's slice and sums in the same order:
    # stopped and resumed, it ends bit for bit where the static run does.
    run_dir, two_bw = tmp_path / "run", [*TWO_BW, f"strategy.execution={execution}"]
    proc = start(run_dir, *two_bw, "train.resume=auto")
    while "step 10/60" not in proc.stdout.readline():
        assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as `kill PID` does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    (step,) = steps_of(checkpoint_dir(run_dir))
    path = checkpoint_dir(run_dir) / f"step-{step:08d}"
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"relaytrain: SIGTERM at step {step}: checkpoint saved to {path}; "
                                            f"continue with train.resume={path}")

    finish(run_dir, *two_bw, "train.resume=auto")
    assert_same_run(run_dir, two_bw_reference)


# ------------------------------------------------------------------------------ refusals and resharding


@pytest.mark.slow  # over 8 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_checkpoint_of_another_model_is_refused_with_one_line(flush_reference, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*RUN, *FLUSH, "model.num_layers=4", f"train.resume={flush_reference}", f"hydra.run.dir={tmp_path}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit this config (num_layers: checkpoint 3 vs config 4)" in err[0]
    assert "checkpoints/step-00000060" in err[0]  # the latest of the run directory given


DETERMINISTIC = ["model.dropout=0.0", "train.steps=6", "train.untimed_steps=1"]


@pytest.fixture(scope="module")
def flush_halfway(tmp_path_factory) -> tuple[Path, Path]:
    """A deterministic 2-stage pipe_flush run, and the same run stopped (checkpointed) halfway."""
    whole, first = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("first")
    finish(whole, *FLUSH, *DETERMINISTIC)
    finish(first, *FLUSH, *DETERMINISTIC, "train.steps=3", "train.checkpoint_every=3")
    return whole, first


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
@pytest.mark.parametrize("then", [["strategy=pipe_flush", "strategy.stages=3"], ["strategy=pipe_2bw"],
                                  ["strategy=l2l"], ["strategy=baseline"]])
def test_a_pipeline_checkpoint_resumes_under_another_layout_or_strategy(flush_halfway, tmp_path, then):
    """Weights and optimizer state are keyed by parameter name, so any strategy picks up a
    2-stage pipeline's checkpoint; with dropout off it continues to the same weights as the
    uninterrupted run (2BW: its first batch uses the current weights as the previous version)."""
    (whole, first), resumed = flush_halfway, tmp_path / "resumed"
    pipeline = then[0].startswith("strategy=pipe")
    out = finish(resumed, "model=bert_tiny", *DETERMINISTIC, *then, f"train.resume={first}",
                 run=RUN if pipeline else COMMON)
    assert f"resuming from step 3 of {checkpoint_dir(first) / 'step-00000003'} (saved by strategy=pipe_flush" in out
    losses = json.loads((resumed / "results.json").read_text())["loss"]
    reference = json.loads((whole / "results.json").read_text())["loss"]
    assert losses[:3] == reference[:3]  # the history carried over
    if then == ["strategy=pipe_2bw"]:
        return  # its delayed updates are a different rule from here on
    assert losses == pytest.approx(reference, rel=1e-5)
    ours, theirs = (load_file(d / "model" / "model.safetensors") for d in (resumed, whole))
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5, msg=name)


def test_only_complete_checkpoints_count_and_the_last_k_are_kept(tmp_path):
    """Parts staged but not published, a missing part or one cut short: never a checkpoint."""
    directory = tmp_path / "checkpoints"
    contents = {"processes": 2, "strategy": "pipe_flush", "layout": {}, "identity": {}}

    def stage(step: int, ranks=(0, 1)) -> None:
        staging = directory / f"step-{step:08d}.parts"
        staging.mkdir(parents=True, exist_ok=True)
        return {name: checkpoint.atomic_write(staging / name, lambda f: torch.save({"step": step}, f))
                for name in [f"part-{r}.pt" for r in ranks] + ["trainer.pt"]}

    for step in (4, 8, 12, 16):
        checkpoint.publish(directory, step, contents, keep=3, checksums=stage(step))
    assert steps_of(directory) == [8, 12, 16]  # step 4 pruned
    stage(20, ranks=(0,))  # rank 1 never wrote: not published
    assert checkpoint.find("auto", tmp_path) == (directory / "step-00000016", [])

    part = directory / "step-00000016" / "part-1.pt"
    flipped = bytearray(part.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01  # one bit, the size unchanged: only the checksum tells
    part.write_bytes(bytes(flipped))
    cut = directory / "step-00000012" / "part-0.pt"
    size = cut.stat().st_size
    os.truncate(cut, size - 100)  # a copy interrupted
    found, passed = checkpoint.find("auto", tmp_path)
    assert found.name == "step-00000008"
    assert passed == ["step-00000016 is damaged (part-1.pt does not match its checksum)",
                      f"step-00000012 is damaged (part-0.pt is cut short ({size - 100} of {size} bytes))"]
    (directory / "step-00000008" / "part-1.pt").unlink()
    assert checkpoint.find("auto", tmp_path)[0] is None  # a fresh start
    with pytest.raises(ConfigError, match="damaged .part-1.pt is missing"):
        checkpoint.find(str(directory / "step-00000008"), tmp_path)
    with pytest.raises(ConfigError, match="damaged .part-1.pt does not match its checksum"):
        checkpoint.find(str(directory / "step-00000016"), tmp_path)


# ------------------------------------------------------------------------------ divergence


def test_a_nan_loss_stops_the_pipeline_naming_the_step(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*RUN, *TWO_BW, "optim=sgd", "optim.lr=1e30", "train.checkpoint_every=1", f"hydra.run.dir={tmp_path}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the loss became" in err[0]
    step = int(err[0].split(" at step ")[1].split()[0])
    kept = steps_of(checkpoint_dir(tmp_path))
    assert kept and max(kept) < step  # only good steps were saved


# ------------------------------------------------------------------------------ schedules


@pytest.mark.parametrize("kind", ["pipe_flush", "pipe_2bw"])
def test_stopping_early_runs_exactly_the_shorter_schedule(kind):
    """At a stop point for batch c, a stage has run exactly the start of the program for
    batches [first, c), and has cast the vote that decides it; resumed programs are valid."""
    lag = schedules()[kind].stop_lag
    for stages in range(1, 5):
        for m in range(stages if kind == "pipe_2bw" else 1, 7):
            for first in (0, 1, 2):
                full = build_schedule(kind, stages, m, first + 6, first)
                check_schedule(full)
                for stage in range(stages):
                    program = full.actions(stage)
                    points = stop_points(program, m)
                    assert sorted(points.values()) == list(range(first + 1, first + 6))
                    for i, c in points.items():
                        assert build_schedule(kind, stages, m, c, first).actions(stage)[:i] == program[:i]
                        voted = [a for a in program[:i] if a.op is Op.REDUCE_GRADS and a.batch == c - lag]
                        assert voted or c - lag < first
