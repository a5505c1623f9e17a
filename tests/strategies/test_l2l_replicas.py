"""L2L across workers: R replicas on real gloo groups equal one worker on the whole minibatch.

Each replica relays every block over its own rows; a block's gradients are summed over the
replicas as soon as its backward ends and the block is updated once, so the weights must be
those of one worker (and of a plain PyTorch loop) over the whole minibatch, up to the float
summation order, with the EPS state replicated or sharded.
"""

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from relaytrain.commands.cli import main
from relaytrain.models import build_model
from relaytrain.run.train import run
from tests.conftest import tiny_cfg, train_plain_loop, wait_for

STEPS = 4


def replicas_cfg(family, strategy, *overrides):
    return tiny_cfg(family, f"strategy={strategy}", "strategy.replicas=2", "strategy.microbatch_size=2",
                    "strategy.num_microbatches=3", f"train.steps={STEPS}", "train.save_model=true",
                    "strategy.timeout_s=60", *overrides)


def one_worker(cfg):
    """`cfg` for one worker that sees every replica's rows: micro-batches twice as large."""
    single = copy.deepcopy(cfg)
    OmegaConf.update(single, "strategy.replicas", 1)
    OmegaConf.update(single, "strategy.microbatch_size", cfg.strategy.microbatch_size * cfg.strategy.replicas)
    return single


def saved_model(cfg, run_dir):
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(run_dir / "model"))
    return build_model(saved.model).hf_model


def assert_same_weights(a, b, atol=2e-6, rtol=1e-5):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize(("family", "strategy", "eps", "optim"), [
    ("bert", "l2l", "sharded", "adamw"),
    ("gpt2", "l2l", "replicated", "lamb"),  # tied wte / LM head
    ("gpt2", "l2l_stash_cpu", "sharded", "sgd"),
    ("bert", "l2l_stash_cpu", "replicated", "adamw"),
])
def test_two_replicas_equal_one_worker_and_a_plain_loop(tmp_path, family, strategy, eps, optim):
    cfg = replicas_cfg(family, strategy, f"strategy.eps_state={eps}", f"optim={optim}")
    results = run(cfg, tmp_path / "replicas")
    single = run(one_worker(cfg), tmp_path / "single")
    ours = saved_model(cfg, tmp_path / "replicas")
    assert_same_weights(ours, saved_model(cfg, tmp_path / "single"))
    assert_same_weights(ours, train_plain_loop(one_worker(cfg), STEPS).hf_model, atol=2e-5, rtol=1e-4)
    assert results["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert results["samples_per_step"] == single["samples_per_step"] == 2 * 2 * 3
    report = results["strategy_report"]
    assert [w["rank"] for w in report["per_worker"]] == [0, 1]
    owned = [w["owned_parameters"] for w in report["per_worker"]]
    if eps == "sharded":  # every parameter owned once, split between the two
        assert sum(owned) == results["model"]["parameters"] and min(owned) > 0
    else:
        assert owned == [results["model"]["parameters"]] * 2
    assert all(w["reduction_s"] >= w["reduction_exposed_s"] >= 0 for w in report["per_worker"])


def test_clipping_with_sharded_state_clips_by_the_global_norm(tmp_path):
    cfg = replicas_cfg("bert", "l2l", "strategy.eps_state=sharded", "optim=sgd", "optim.momentum=0.0",
                       "optim.lr=1.0", "optim.grad_clip=1e-3", f"train.steps={2}", "train.untimed_steps=0")
    run(cfg, tmp_path / "replicas")
    run(one_worker(cfg), tmp_path / "single")
    assert_same_weights(saved_model(cfg, tmp_path / "replicas"), saved_model(cfg, tmp_path / "single"))


@pytest.mark.slow  # as the fault matrix's kill rows (tests/test_faults.py), which run in the same step
def test_a_killed_two_replica_run_resumes_bit_for_bit(tmp_path):
    common = ["train", "strategy=l2l", "strategy.replicas=2", "strategy.microbatch_size=4",
              "strategy.num_microbatches=2", "model.num_layers=3", "model.hidden_size=64", "model.num_heads=4",
              "model.intermediate_size=128", "model.vocab_size=512", "model.dropout=0.1", "data.seq_len=32",
              "data.num_samples=512", "train.steps=40", "train.untimed_steps=1", "train.save_model=true",
              "train.checkpoint_every=5", "train.resume=auto"]

    def start(run_dir: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "relaytrain.commands.cli", *common, f"hydra.run.dir={run_dir}"],
                                env={**os.environ, "CI": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main([*common, f"hydra.run.dir={whole}"]) == 0
    proc = start(resumed)
    wait_for(resumed / "checkpoints" / "step-00000015", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers, mid-step
    proc.communicate(timeout=60)
    assert not (resumed / "results.json").exists()
    proc = start(resumed)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resuming from step" in out and "saved by" not in out  # the same layout: exact
    losses = [json.loads((d / "results.json").read_text())["loss"] for d in (resumed, whole)]
    assert losses[0] == losses[1]
    ours, theirs = (load_file(d / "model" / "model.safetensors") for d in (resumed, whole))
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_replicas_the_machine_cannot_run_are_refused_before_any_worker_starts(capsys):
    assert main(["train", "strategy=l2l", "strategy.replicas=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs 64 workers on" in err[0]
    assert main(["train", "strategy=l2l", "strategy.replicas=0"]) == 2
    assert "strategy.replicas=0 must be at least 1" in capsys.readouterr().err
