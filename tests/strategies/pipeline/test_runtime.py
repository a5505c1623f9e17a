"""Pipelines on real gloo process groups on localhost, against single-process references.

Each launch starts stages x replicas worker processes, so every test checks as much as one
launch can: final weights (through the saved Hugging Face model, which also checks
`train.save_model`), losses and results.json.
"""

import copy
import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch
from omegaconf import OmegaConf

from relaytrain.commands.cli import main
from relaytrain.data import build_dataset, build_loader
from relaytrain.models import build_model
from relaytrain.placement.layout import Layout
from relaytrain.run.launch import failure
from relaytrain.run.train import run
from relaytrain.step.optim import lr_at
from relaytrain.strategies import build_strategy
from relaytrain.strategies.pipeline.config import SEGMENT_VARIABLE
from relaytrain.strategies.pipeline.runtime import WeightVersions
from relaytrain.strategies.pipeline.stage import StageModule
from relaytrain.utils import failpoints
from relaytrain.utils.errors import ConfigError
from tests.conftest import tiny_cfg, train_plain_loop

STEPS = 4


def pipeline_cfg(family, *overrides):
    return tiny_cfg(family, f"train.steps={STEPS}", "train.save_model=true", "strategy.timeout_s=60", *overrides)


def trained_by_pipeline(cfg, run_dir):
    """Run the pipeline; return its results and the model it saved, loaded back."""
    results = run(cfg, run_dir)
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(run_dir / "model"))
    return results, build_model(saved.model).hf_model


def whole_minibatch_cfg(cfg, name="baseline"):
    """`cfg` for one process that sees every replica's rows: micro-batches replicas times larger."""
    single = copy.deepcopy(cfg)
    OmegaConf.update(single, "strategy.name", name)
    OmegaConf.update(single, "strategy.microbatch_size", cfg.strategy.microbatch_size * cfg.strategy.replicas)
    OmegaConf.update(single, "strategy.replicas", 1)
    return single


def trained_by_baseline(cfg):
    cfg = whole_minibatch_cfg(cfg)
    model = build_model(cfg.model, cfg.train.seed)
    strategy = build_strategy(model, cfg)
    loader = iter(build_loader(cfg, build_dataset(cfg)))
    losses = [strategy.step(next(loader), lr_at(s, cfg.optim, STEPS)).loss for s in range(STEPS)]
    return model.hf_model, losses


def trained_by_delayed_gradients(cfg):
    """The 2BW rule in one process: W(b+1) = W(b) - lr * grad f_b(W(max(b-1, 0))), via the optimizer."""
    return train_plain_loop(whole_minibatch_cfg(cfg), STEPS, delay=1).hf_model


def assert_same_weights(a, b, atol=2e-5):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=1e-4, msg=name)


def test_flush_gpt2_tied_across_two_stages_and_two_replicas_equals_baseline(tmp_path):
    # 3 blocks over 2 stages: [2, 1]; wte on stage 0 and lm_head on stage 1 are one tied weight.
    cfg = pipeline_cfg("gpt2", "strategy=pipe_flush", "strategy.stages=2", "strategy.replicas=2",
                       "strategy.microbatch_size=2", "strategy.num_microbatches=3", "optim=sgd", "optim.lr=0.05")
    results, ours = trained_by_pipeline(cfg, tmp_path / "pipe")
    baseline, baseline_losses = trained_by_baseline(cfg)
    assert_same_weights(ours, baseline)
    assert_same_weights(ours, train_plain_loop(whole_minibatch_cfg(cfg), STEPS).hf_model)
    assert torch.equal(ours.transformer.wte.weight, ours.lm_head.weight)
    assert results["loss"] == pytest.approx(baseline_losses, rel=1e-5)

    baseline_run = run(whole_minibatch_cfg(cfg), tmp_path / "baseline", [])
    assert results.keys() == baseline_run.keys()
    report = results["strategy_report"]
    assert report["layout"] == [2, 1] and len(report["per_stage"]) == 4
    assert results["samples_per_step"] == baseline_run["samples_per_step"] == 2 * 3 * 2
    assert [p["rank"] for p in results["memory"]["per_process"]] == [0, 1, 2, 3]
    assert all(p["host_peak_rss_bytes"] > 0 for p in results["memory"]["per_process"])
    assert report["bubble_fraction_formula"] == pytest.approx(1 / 4)
    assert json.loads((tmp_path / "pipe" / "results.json").read_text())["strategy"] == "pipe_flush"


@pytest.mark.parametrize("recompute", ["block", pytest.param("stage", marks=pytest.mark.slow)])  # stage's: the slow step
def test_flush_bert_three_uneven_stages_with_recompute_equals_baseline(tmp_path, recompute):
    cfg = pipeline_cfg("bert", "model.num_layers=4", "strategy=pipe_flush", "strategy.stages=3",
                       "strategy.layout=[1,2,1]", f"strategy.recompute={recompute}", "strategy.microbatch_size=2",
                       "strategy.num_microbatches=4", "optim.lr=1e-3")
    results, ours = trained_by_pipeline(cfg, tmp_path)
    baseline, baseline_losses = trained_by_baseline(cfg)
    assert_same_weights(ours, baseline)
    assert_same_weights(ours, train_plain_loop(whole_minibatch_cfg(cfg), STEPS).hf_model)
    assert results["loss"] == pytest.approx(baseline_losses, rel=1e-5)
    assert [s["blocks"] for s in results["strategy_report"]["per_stage"]] == [1, 2, 1]


def test_gpipe_registered_from_its_own_module_equals_the_plain_loop(tmp_path):
    cfg = pipeline_cfg("gpt2", "strategy=pipe_gpipe", "strategy.stages=3", "strategy.microbatch_size=2",
                       "strategy.num_microbatches=3", "optim=adamw", "optim.lr=1e-3")
    results, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, train_plain_loop(whole_minibatch_cfg(cfg), STEPS).hf_model)
    assert results["strategy"] == "pipe_gpipe" and results["strategy_report"]["layout"] == [1, 1, 1]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_2bw_equals_the_delayed_gradient_rule(tmp_path, optimizer):
    # m = 3 >= d = 2, 4 updates: versions 0, 0, 1, 2 are used by batches 0..3.
    family = "gpt2" if optimizer == "sgd" else "bert"
    cfg = pipeline_cfg(family, "strategy=pipe_2bw", "strategy.stages=2", "strategy.microbatch_size=2",
                       "strategy.num_microbatches=3", f"optim={optimizer}",
                       "optim.lr=0.05" if optimizer == "sgd" else "optim.lr=1e-3")
    _, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, trained_by_delayed_gradients(cfg))
    with pytest.raises(AssertionError):  # and the delay is real: not the baseline's weights
        assert_same_weights(ours, trained_by_baseline(cfg)[0])


def test_2bw_s_program_built_a_segment_at_a_time_keeps_the_delayed_rule_across_segments(tmp_path, monkeypatch):
    """A stage builds its program a segment of batches at a time (not train.steps' worth before
    its first step); segments of 2 batches over 4 updates still follow the delayed rule."""
    monkeypatch.setenv(SEGMENT_VARIABLE, "2")  # the workers receive the launcher's environment
    cfg = pipeline_cfg("bert", "strategy=pipe_2bw", "strategy.stages=2", "strategy.microbatch_size=2",
                       "strategy.num_microbatches=3", "optim=adamw", "optim.lr=1e-3")
    _, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, trained_by_delayed_gradients(cfg))


def test_a_parameter_without_gradient_is_not_updated_as_in_the_baseline():
    """take_grads hands None for it; the optimizer then skips it (no momentum, no weight decay),
    as the baseline's optimizer does for a parameter whose .grad is None."""
    cfg = tiny_cfg("bert", "strategy=pipe_2bw", "optim=adamw", "optim.weight_decay=0.1")
    model = build_model(cfg.model, cfg.train.seed)
    stage = StageModule(model, range(model.num_blocks), first=True, last=True)
    versions = WeightVersions(stage, versions=2, optim_cfg=cfg.optim)
    untouched = len(versions.params[0]) - 1
    for i, p in enumerate(versions.params[0]):
        p.grad = None if i == untouched else torch.ones_like(p)
    before = [p.detach().clone() for p in versions.params[0]]
    grads = versions.take_grads(0)
    assert grads[untouched] is None and all(g is not None for g in grads[:untouched])
    versions.apply(grads, lr=0.1)
    after = versions.params[1]  # version 1 lives in the second buffer
    assert torch.equal(after[untouched], before[untouched])
    assert all(not torch.equal(a, b) for a, b in zip(after[:untouched], before[:untouched], strict=True))
    assert after[untouched] not in versions.optimizer.state


@pytest.mark.parametrize("execution", ["static", pytest.param("message_driven", marks=pytest.mark.slow)])
def test_killing_a_worker_ends_the_run_with_a_clear_error_in_bounded_time(tmp_path, execution, monkeypatch):
    """The peer of a killed worker waits in a transfer; the launcher ends it long before
    strategy.timeout_s would. Rank 1 is held before step 3 (a failpoint), then killed."""
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(failpoints.VARIABLE, "step:3:1=hold")  # the spawned workers inherit it
    monkeypatch.setenv(failpoints.MARKS, str(marks))
    cfg = pipeline_cfg("bert", "strategy=pipe_flush", "strategy.stages=2", "train.steps=100000",
                       "train.save_model=false", "strategy.timeout_s=600", f"strategy.execution={execution}")
    killed_at = []

    def kill_the_held_worker():
        while not (marks / "step-3-1").exists():
            time.sleep(0.01)
        os.kill(int((marks / "step-3-1").read_text()), signal.SIGKILL)
        killed_at.append(time.monotonic())

    threading.Thread(target=kill_the_held_worker, daemon=True).start()
    with pytest.raises(ConfigError) as failed:
        run(cfg, tmp_path)
    assert killed_at, "the run ended before a worker was killed"
    assert time.monotonic() - killed_at[0] < 300, "the run waited for the transfer timeout"
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("worker rank 1 (stage 1 of 2) was killed by SIGKILL during step 3")
    assert not [c for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())]


def test_the_first_error_is_the_one_reported(tmp_path):
    """A rank that raised is the cause; the peers that lost it failed later. A user's error
    (a ConfigError, e.g. a NaN loss) is shown as it is."""
    layout = Layout(stage=3)
    records = ((2, 5.0, "RuntimeError", "Connection closed by peer", False), (1, 4.0, "ValueError", "boom", False))
    for rank, when, error, message, user in records:
        record = {"rank": rank, "time": when, "error": error, "message": message, "user_error": user}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))

    class Exited:
        exitcode = 1

    def explain(failed):
        return str(failure([Exited(), Exited(), Exited()], failed, layout.describe, tmp_path,
                           when=lambda rank: "during step 5", latest=tmp_path / "step-00000004", timeout_s=60))

    line = explain([1, 2])
    assert line.startswith("worker rank 1 (stage 1 of 3) failed during step 5: ValueError: boom")
    assert line.endswith(f"the newest complete checkpoint is {tmp_path / 'step-00000004'}: "
                         f"continue with train.resume={tmp_path / 'step-00000004'}")
    record = {"rank": 0, "time": 1.0, "error": "TrainingDiverged", "message": "the loss became nan at step 3",
              "user_error": True}
    (tmp_path / "rank0.json").write_text(json.dumps(record))
    assert explain([0, 1, 2]) == record["message"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=pipe_2bw", "strategy.stages=3", "strategy.num_microbatches=2"], "num_microbatches >= "),
        (["strategy=pipe_flush", "strategy.stages=3", "strategy.replicas=100"], "300 workers on"),
        (["strategy=pipe_flush", "precision=amp_fp16"], "precision=amp_fp16 needs one loss-scale decision"),
        (["strategy=pipe_flush", "optim.grad_clip=1.0"], "optim.grad_clip=1.0: global-norm clipping"),
        (["strategy=pipe_flush", "strategy.backend=nccl", "train.device=cpu"], "backend=nccl needs CUDA"),
        (["strategy=pipe_flush", "strategy.backend=mpi"], "strategy.backend=mpi is not one of auto, gloo, nccl"),
        (["strategy=pipe_2bw", "strategy.stages=1"], "one stage is not a pipeline; use strategy=baseline"),
        (["strategy=pipe_gpipe", "strategy.stages=5"], "strategy.stages=5 exceeds model.num_layers=4"),
    ],
)
def test_bad_configs_are_refused_before_any_process_starts(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_workers_do_not_outlive_a_killed_launcher(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    launcher = subprocess.Popen(
        [sys.executable, "-m", "relaytrain.commands.cli", "train", "strategy=pipe_flush", "train.steps=100000",
         "train.untimed_steps=1", f"hydra.run.dir={tmp_path}"],
        env={**os.environ, "CI": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    workers = []
    while len(workers) < 2:
        assert time.monotonic() < deadline and launcher.poll() is None, "the workers never started"
        workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "python" in p.name().lower()]
        time.sleep(0.2)
    launcher.send_signal(signal.SIGKILL)  # the launcher alone, not its process group
    launcher.wait(timeout=30)
    _, alive = psutil.wait_procs(workers, timeout=60)  # a loaded CI machine: orphans notice within seconds, not at once
    for orphan in alive:  # leave no stray trainer behind, even when the check fails
        orphan.kill()
    assert not alive, f"workers still running after their launcher died: {[p.pid for p in alive]}"
