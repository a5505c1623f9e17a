"""How local workers start: forked from a warm server (the default), or spawned afresh.

Both must run the same training: a worker forked from the server gets the launcher's
environment as it is at launch (not the server's, from when it started), and every worker
starts deaf to SIGINT and SIGTERM (test_watch.py stops runs through them).
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.placement.world import threads_per_process
from relaytrain.run.launch import START_METHOD, _worker_context
from relaytrain.run.train import run
from relaytrain.utils import failpoints
from relaytrain.utils.errors import ConfigError
from tests.conftest import THREADS, tiny_cfg


def two_replicas(*overrides):
    return tiny_cfg("gpt2", "strategy=baseline", "strategy.replicas=2", "train.steps=2", "train.save_model=true",
                    "strategy.timeout_s=60", *overrides)


def test_a_start_method_that_does_not_exist_is_one_line(monkeypatch):
    monkeypatch.setenv(START_METHOD, "fork")
    with pytest.raises(ConfigError, match="RELAYTRAIN_WORKER_START='fork': use forkserver or spawn"):
        _worker_context()


def test_a_forked_worker_reads_the_environment_the_launcher_has_now(monkeypatch, tmp_path):
    """The server started long before (another test's run, say); a fault set now still reaches
    the worker it names."""
    run(two_replicas(), tmp_path / "warm")  # the fork server is up from here on
    monkeypatch.setenv(failpoints.VARIABLE, "checkpoint:1:1=enospc")
    with pytest.raises(ConfigError, match="No space left on device"):
        run(two_replicas("train.checkpoint_every=1"), tmp_path / "struck")


@pytest.mark.slow
def test_spawned_and_forked_workers_train_the_same_weights(monkeypatch, tmp_path):
    run(two_replicas(), tmp_path / "forked")
    monkeypatch.setenv(START_METHOD, "spawn")
    run(two_replicas(), tmp_path / "spawned")
    forked, spawned = (load_file(tmp_path / name / "model" / "model.safetensors") for name in ("forked", "spawned"))
    assert forked.keys() == spawned.keys()
    for name in forked:
        assert torch.equal(forked[name], spawned[name]), name


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_workers_share_out_the_cores_the_process_may_use_not_the_machines():
    """Under taskset, a container's cpuset or a batch scheduler's allocation, a process may use
    fewer cores than the machine has: one thread per allowed core, not per installed one."""
    allowed = sorted(os.sched_getaffinity(0))[:1]
    code = "from relaytrain.placement.world import threads_per_process as t; print(t(0, 1), t(3, 1))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, allowed)).stdout.split()
    assert out == ["1", "3"]  # the configured train.threads is kept as given


@pytest.mark.parametrize(("env", "expected"), [({"OMP_NUM_THREADS": "1"}, ["1", "1", "3"]),
                                               ({"OMP_NUM_THREADS": "64"}, ["2", "1", "3"]),
                                               ({"OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "2"}, ["2", "1", "3"]),
                                               ({}, ["2", "1", "3"])])
def test_omp_num_threads_asks_for_fewer_threads_but_torchruns_default_does_not(env, expected):
    """On 2 cores: one worker, two workers, train.threads=3. torchrun sets OMP_NUM_THREADS=1 for
    every worker of a machine that runs several: not the user's choice, left out."""
    code = "from relaytrain.placement.world import threads_per_process as t; print(t(0, 1, 2), t(0, 2, 2), t(3, 1, 2))"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**clean, **env}).stdout.split()
    assert out == expected


def test_a_run_in_this_process_takes_its_own_thread_count_and_gives_the_callers_back(tmp_path, monkeypatch):
    """The planner's profile times with `threads_per_process`; a run in a process that set
    another count (a sweep's earlier run, a benchmark, a notebook) computes with the profile's,
    and the caller has its own back after."""
    from relaytrain.run import train

    seen, trains = [], train.Trainer.run
    monkeypatch.setattr(train.Trainer, "run", lambda self: seen.append(torch.get_num_threads()) or trains(self))
    torch.set_num_threads(THREADS + 1)
    run(tiny_cfg("bert", "train.steps=1"), tmp_path / "run", table=False)
    assert seen == [threads_per_process(0, 1)] == [THREADS]
    assert torch.get_num_threads() == THREADS + 1
