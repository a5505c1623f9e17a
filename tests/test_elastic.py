"""Elastic restarts under torchrun: a worker killed mid-run, torchrun restarts the group, the run
resumes from its newest complete checkpoint and ends with the weights of a run never killed."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.commands.cli import main
from relaytrain.run import elastic
from relaytrain.run.compose import compose_config
from tests.conftest import TINY_GPT2, wait_for

CPU = torch.device("cpu")

# torchrun runs this script in every worker. With HOLD_DIR set, rank 1 of the first attempt
# stops before step 5 (the step-4 checkpoint is saved by then, or being published by rank 0),
# writes its pid to HOLD_DIR/held and waits there: the test kills it at a point that does not
# depend on how fast the machine is. Later attempts run normally.
WORKER = """
import os, sys, threading
from pathlib import Path
from relaytrain.run import train
from relaytrain.commands.cli import main

hold = os.environ.get("HOLD_DIR")
plain_step = train.Trainer._step

def held_step(self, step):
    if hold and step == 4 and self.world.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        tmp = Path(hold, "held.tmp")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, Path(hold, "held"))
        threading.Event().wait()
    return plain_step(self, step)

train.Trainer._step = held_step
sys.exit(main(sys.argv[1:]))
"""

RUN = ["train", *[o for o in TINY_GPT2 if not o.startswith("model.dropout")], "model.dropout=0.1",
       "train.steps=8", "train.untimed_steps=1", "train.checkpoint_every=2", "train.save_model=true",
       "strategy.timeout_s=60"]

STRATEGIES = [
    # ~45 s each on 2 cores: the slow step (the default suite stays within 8 minutes)
    pytest.param(["strategy=pipe_flush", "strategy.stages=2"], id="pipe_flush", marks=pytest.mark.slow),
    pytest.param(["strategy=pipe_2bw", "strategy.stages=2"], id="pipe_2bw", marks=pytest.mark.slow),
    pytest.param(["strategy=l2l", "strategy.replicas=2"], id="l2l-replicas", marks=pytest.mark.slow),
]


def torchrun(tmp_path: Path, run_dir: Path, strategy: list[str], hold: Path | None = None) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "CI": "1"}
    env.pop("HOLD_DIR", None)
    if hold is not None:
        env["HOLD_DIR"] = str(hold)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(script), *RUN, *strategy, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    return out


def weights(run_dir: Path) -> dict:
    return load_file(run_dir / "model" / "model.safetensors")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_worker_killed_mid_run_is_restarted_and_resumes_bit_for_bit(tmp_path, strategy):
    whole_dir, run_dir, hold = tmp_path / "whole", tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    finished(torchrun(tmp_path, whole_dir, strategy))
    whole = json.loads((whole_dir / "results.json").read_text())
    assert whole["restarts"] == {"count": 0, "max": 1, "resumed_from": []}

    proc = torchrun(tmp_path, run_dir, strategy, hold)
    wait_for(hold / "held", proc, timeout=180)  # rank 1 waits before step 5
    wait_for(run_dir / "checkpoints" / "step-00000004" / "manifest.json", proc, timeout=180)  # complete
    os.kill(int((hold / "held").read_text()), signal.SIGKILL)
    out = finished(proc)

    # train.resume was not given: under a restart policy it is `auto`
    assert "restart 1 of the run (torchrun attempt 1): resuming from step 4 of" in out
    resumed = json.loads((run_dir / "results.json").read_text())
    checkpoint = str(run_dir / "checkpoints" / "step-00000004")
    assert resumed["restarts"] == {"count": 1, "max": 1,
                                   "resumed_from": [{"attempt": 1, "step": 4, "checkpoint": checkpoint}]}
    assert resumed["loss"] == whole["loss"]
    ours, theirs = weights(run_dir), weights(whole_dir)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.fixture
def restart_policy(monkeypatch):
    """This process seen as rank 0 of a torchrun launch with --max-restarts 1 (nothing joins)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "1",
                        "TORCHELASTIC_RUN_ID": "test"}.items():
        monkeypatch.setenv(name, value)


def test_a_time_stamped_run_directory_is_refused_under_a_restart_policy(tmp_path, monkeypatch, capsys,
                                                                         restart_policy):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([*RUN, "strategy=pipe_flush", "strategy.stages=2"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hydra.run.dir" in err[0] and "torchrun with restarts" in err[0], err
    assert not list(tmp_path.glob("outputs/*/*/checkpoints"))  # nothing started


def test_train_resume_defaults_to_auto_under_a_restart_policy(restart_policy):
    cfg = compose_config(TINY_GPT2)
    assert cfg.train.resume is None
    assert elastic.prepare(cfg, CPU).train.resume == "auto"
    assert elastic.prepare(compose_config([*TINY_GPT2, "train.resume=/some/where"]), CPU).train.resume == "/some/where"


def test_train_resume_stays_unset_without_a_restart_policy(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert elastic.prepare(compose_config(TINY_GPT2), CPU).train.resume is None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_two_launchers_as_two_nodes_equal_one_launcher(tmp_path):
    """A cluster's two machines, here two torchrun launchers on localhost (one worker each,
    a shared run directory as a cluster's shared filesystem): the same weights as one launcher
    starting both workers. One thread a worker in both: a launcher gives its workers the cores
    it sees, and another thread count sums in another order."""
    strategy = ["strategy=pipe_flush", "strategy.stages=2", "train.threads=1"]
    env = {**os.environ, "CI": "1"}
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "relaytrain.commands.cli", *RUN, *strategy, f"hydra.run.dir={tmp_path / 'two'}"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    for node in nodes:
        finished(node)
    one = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "relaytrain.commands.cli", *RUN, *strategy, f"hydra.run.dir={tmp_path / 'one'}"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finished(one)
    ours, theirs = weights(tmp_path / "two"), weights(tmp_path / "one")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    losses = [json.loads((tmp_path / d / "results.json").read_text())["loss"] for d in ("two", "one")]
    assert losses[0] == losses[1]
