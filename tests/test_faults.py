"""The fault matrix (docs/faults.md): for each fault a cluster deals a run of several workers,
what the user sees (one line: which worker, when), what is kept on disk, and the weights after
`train.resume=auto` against a run that never failed.

Faults are injected at named points (relaytrain.utils.failpoints): a held worker writes its pid and
waits, and the test kills or stops it there, so nothing depends on the machine's speed.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.utils import failpoints
from relaytrain.utils.errors import ConfigError
from tests.conftest import TINY_GPT2, wait_for

RUN = ["train", *[o for o in TINY_GPT2 if not o.startswith("model.dropout")], "model.dropout=0.1",
       "train.steps=8", "train.untimed_steps=1", "train.checkpoint_every=2", "train.save_model=true",
       "data.eval_fraction=0.1", "eval.every=2", "eval.max_batches=2", "strategy.timeout_s=5"]
# A run meant to finish waits as long as a loaded machine needs: the 5 s above is for the runs a
# fault stops (a hung worker given up on), and a slow finish under load must not read as one.
FINISHING = "strategy.timeout_s=300"

STRATEGIES = {
    "pipe_flush": ["strategy=pipe_flush", "strategy.stages=2"],
    "pipe_2bw": ["strategy=pipe_2bw", "strategy.stages=2"],
    "l2l-replicas": ["strategy=l2l", "strategy.replicas=2"],
    "baseline-replicas": ["strategy=baseline", "strategy.replicas=2"],
    "fsdp": ["strategy=fsdp", "strategy.replicas=2"],
}
EVERY_STRATEGY = pytest.mark.parametrize("strategy", list(STRATEGIES))
pytestmark = pytest.mark.slow  # two or three runs of two workers each: minutes for the matrix


def start(run_dir: Path, strategy: str, faults: str = "", marks: Path | None = None, *extra: str) -> subprocess.Popen:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CI": "1", failpoints.VARIABLE: faults}
    if marks is not None:
        marks.mkdir(exist_ok=True)
        env[failpoints.MARKS] = str(marks)
    cmd = [sys.executable, "-m", "relaytrain.commands.cli", *RUN, *STRATEGIES[strategy], *extra, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, env=env, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def ended(proc: subprocess.Popen, code: int) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, out[-3000:] + err[-3000:]
    return out, err


def the_error(err: str) -> str:
    """The run's one line of error (warnings from libraries may precede it)."""
    lines = [line for line in err.splitlines() if line.startswith("relaytrain: error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0].removeprefix("relaytrain: error: ")


def held_pid(marks: Path, name: str, proc: subprocess.Popen) -> int:
    wait_for(marks / name, proc, timeout=240)
    return int((marks / name).read_text())


def steps_on_disk(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights each strategy ends with when nothing fails (made once per strategy)."""
    made: dict[str, dict] = {}

    def weights(strategy: str) -> dict:
        if strategy not in made:
            run_dir = tmp_path_factory.mktemp("whole") / strategy
            ended(start(run_dir, strategy, "", None, FINISHING), 0)
            made[strategy] = load_file(run_dir / "model" / "model.safetensors")
        return made[strategy]

    return weights


def resumes_to_the_uninterrupted_weights(run_dir: Path, strategy: str, uninterrupted, step: int) -> str:
    out, _ = ended(start(run_dir, strategy, "", None, "train.resume=auto", FINISHING), 0)
    assert f"resuming from step {step} of" in out
    ours, theirs = load_file(run_dir / "model" / "model.safetensors"), uninterrupted(strategy)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    return out


def newest(run_dir: Path, step: int) -> str:
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    return f"the newest complete checkpoint is {path}: continue with train.resume={path}"


def strike(tmp_path, strategy: str, point: str, step: int, sig: int) -> tuple[Path, str]:
    """Hold worker 1 at `point` of `step`, send it `sig` there, and return the run directory and
    the launcher's one-line error (the run must end with exit 2)."""
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    proc = start(run_dir, strategy, f"{point}:{step}:1=hold", marks)
    os.kill(held_pid(marks, f"{point}-{step}-1", proc), sig)
    _, err = ended(proc, 2)
    return run_dir, the_error(err)


@EVERY_STRATEGY
def test_a_worker_killed_mid_step(tmp_path, strategy, uninterrupted):
    run_dir, line = strike(tmp_path, strategy, "step", 5, signal.SIGKILL)
    assert "was killed by SIGKILL during step 5; the other workers were stopped" in line
    assert line.startswith("worker ") and line.endswith(newest(run_dir, 4))
    assert steps_on_disk(run_dir) == ["step-00000002", "step-00000004"]
    resumes_to_the_uninterrupted_weights(run_dir, strategy, uninterrupted, 4)


@EVERY_STRATEGY
def test_a_worker_killed_mid_checkpoint(tmp_path, strategy, uninterrupted):
    run_dir, line = strike(tmp_path, strategy, "checkpoint", 4, signal.SIGKILL)  # its part written, not published
    assert "was killed by SIGKILL while saving the checkpoint of step 4" in line
    assert line.endswith(newest(run_dir, 2))
    assert steps_on_disk(run_dir) == ["step-00000002"]  # what was staged for step 4 is removed
    resumes_to_the_uninterrupted_weights(run_dir, strategy, uninterrupted, 2)


@EVERY_STRATEGY
def test_a_worker_killed_mid_evaluation(tmp_path, strategy, uninterrupted):
    run_dir, line = strike(tmp_path, strategy, "evaluate", 4, signal.SIGKILL)
    assert "was killed by SIGKILL during the evaluation after step 4" in line
    assert line.endswith(newest(run_dir, 2))  # step 4's checkpoint comes after its evaluation
    resumes_to_the_uninterrupted_weights(run_dir, strategy, uninterrupted, 2)


@EVERY_STRATEGY
def test_a_worker_that_hangs_past_the_timeout(tmp_path, strategy, uninterrupted):
    run_dir, line = strike(tmp_path, strategy, "step", 5, signal.SIGSTOP)
    assert "was stopped (SIGSTOP or a debugger) during step 5; the others gave up waiting for it after " \
           "strategy.timeout_s=5 s" in line
    assert line.endswith(newest(run_dir, 4))
    resumes_to_the_uninterrupted_weights(run_dir, strategy, uninterrupted, 4)


@EVERY_STRATEGY
def test_the_disk_filling_during_a_checkpoint(tmp_path, strategy, uninterrupted):
    run_dir = tmp_path / "run"
    _, err = ended(start(run_dir, strategy, "checkpoint:4:1=enospc"), 2)
    line = the_error(err)
    assert line.startswith("the checkpoint of step 4 could not be written (No space left on device")
    assert line.endswith(f"the newest complete checkpoint is {run_dir / 'checkpoints' / 'step-00000002'}: make room, "
                         f"then continue with train.resume={run_dir / 'checkpoints' / 'step-00000002'}")
    assert steps_on_disk(run_dir) == ["step-00000002"]  # the half-written one gave its space back
    resumes_to_the_uninterrupted_weights(run_dir, strategy, uninterrupted, 2)


@EVERY_STRATEGY
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, strategy, uninterrupted):
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    proc = start(run_dir, strategy, "step:7:1=hold", marks)
    os.kill(held_pid(marks, "step-7-1", proc), signal.SIGKILL)
    ended(proc, 2)
    part = run_dir / "checkpoints" / "step-00000006" / "part-1.pt"
    damaged = bytearray(part.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # the size unchanged: only the checksum can tell
    part.write_bytes(bytes(damaged))
    out = resumes_to_the_uninterrupted_weights(run_dir, strategy, uninterrupted, 4)
    assert "checkpoint step-00000006 is damaged (part-1.pt does not match its checksum): passed over " \
           "for an earlier one" in out


@EVERY_STRATEGY
def test_a_nan_loss_at_a_named_step(tmp_path, strategy, uninterrupted):
    run_dir = tmp_path / "run"
    _, err = ended(start(run_dir, strategy, "loss:5=nan"), 2)
    line = the_error(err)
    assert line == f"the loss became nan at step 5 under precision=fp32; {newest(run_dir, 4)}".replace(
        ": continue with", ": lower optim.lr, then continue with")
    assert steps_on_disk(run_dir) == ["step-00000002", "step-00000004"]  # nothing after the step that diverged
    resumes_to_the_uninterrupted_weights(run_dir, strategy, uninterrupted, 4)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small filesystem needs root")
def test_a_real_full_disk_keeps_the_complete_checkpoints(tmp_path):
    """A tmpfs with room for the run's other files and two and a half checkpoints
    (keep_checkpoints=0 keeps them all): a later checkpoint cannot be written."""
    def used(files) -> int:  # what a filesystem gives them: whole blocks
        return sum(f.stat().st_blocks * 512 for f in files if f.is_file())

    sizing = tmp_path / "sizing" / "run"
    ended(start(sizing, "pipe_flush", "", None, "train.steps=2", "train.save_model=false"), 0)
    one = used((sizing / "checkpoints" / "step-00000002").rglob("*"))
    others = used(sizing.rglob("*")) - one
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={others + 2 * one + one // 2}", "tmpfs",
                       str(disk)]).returncode != 0:
        pytest.skip("this machine cannot mount a tmpfs")
    try:
        run_dir = disk / "run"
        _, err = ended(start(run_dir, "pipe_flush", "", None, "train.keep_checkpoints=0"), 2)
        line = the_error(err)
        assert line.startswith("the checkpoint of step ") and "(No space left on device" in line
        failed = int(line.removeprefix("the checkpoint of step ").split()[0])
        assert failed >= 6  # two fitted
        kept = [f"step-{step:08d}" for step in range(2, failed, 2)]
        assert steps_on_disk(run_dir) == kept  # complete, and nothing half-written beside them
        assert line.endswith(f"make room, then continue with train.resume={run_dir / 'checkpoints' / kept[-1]}")
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_fault_spec_that_cannot_be_read_is_one_line():
    with pytest.raises(ConfigError, match="cannot read 'step:5=kill'"):
        failpoints.parse("step:5=kill")
    with pytest.raises(ConfigError, match="STEP and RANK are whole numbers"):
        failpoints.parse("step:five:1=hold")
    assert failpoints.parse("step:5:1=hold; loss:3=nan") == {("step", 5, 1): "hold", ("loss", 3, None): "nan"}


def test_no_fault_is_reached_unless_asked(monkeypatch):
    monkeypatch.delenv(failpoints.VARIABLE, raising=False)
    assert failpoints.reach("checkpoint", 4, 1) is None
    monkeypatch.setenv(failpoints.VARIABLE, "checkpoint:4:1=enospc;loss:5=nan")
    with pytest.raises(OSError, match="No space left on device"):
        failpoints.reach("checkpoint", 4, 1)
    assert failpoints.reach("checkpoint", 4, 0) is None
    assert failpoints.reach("loss", 5, 3) == "nan"
