"""`strategy.offload=host` (AxoNN's memory optimization): a stage's fp32 masters and optimizer
state in host memory, served by the eager param server, bucketed updates overlapped with the
copies; the device keeps the working weights (two versions under 2BW) and the gradients.

With real gloo groups the weights equal the plain loop (flush) and the delayed-gradient rule
(2BW), for BERT and for GPT-2 with its tied embedding on the first and last stage; a killed
run resumes bit for bit, with offload or without (the checkpoint is keyed by parameter name
either way). A dry run on the meta device shows the optimizer state gone from the device.
"""

import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.models import build_model
from relaytrain.planner.dryrun import simulate
from relaytrain.records.checkpoint import checkpoint_dir
from relaytrain.run.compose import compose_config
from relaytrain.strategies.pipeline.offload import HostVersions
from relaytrain.strategies.pipeline.stage import StageModule
from relaytrain.strategies.pipeline.weights import WeightVersions
from tests.conftest import tiny_cfg, train_plain_loop, wait_for
from tests.strategies.pipeline.test_runtime import (
    STEPS,
    assert_same_weights,
    pipeline_cfg,
    trained_by_delayed_gradients,
    trained_by_pipeline,
    whole_minibatch_cfg,
)
from tests.strategies.pipeline.test_runtime_checkpoint import (
    TWO_BW,
    assert_same_run,
    finish,
    kill_group,
    start,
)

OFFLOAD = "strategy.offload=host"

# ------------------------------------------------------------------ the update, no processes


def two_versions(cls, cfg, **kwargs):
    model = build_model(cfg.model, cfg.train.seed)
    stage = StageModule(model, range(1, 3), first=False, last=True)
    return cls(stage, 2, cfg.optim, **kwargs)


def test_host_versions_update_as_the_device_optimizer_does_bit_for_bit():
    """2BW's W(b+1) = W(b) - lr * g: the host master is the newest version, the result lands in
    the device buffer that held W(b-1); the other buffer is never touched by the update."""
    cfg = tiny_cfg("bert", "strategy=pipe_2bw", "optim=adamw", "optim.weight_decay=0.1")
    device, host = two_versions(WeightVersions, cfg), two_versions(HostVersions, cfg, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for update in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in device.params[0]]
        untouched = [p.detach().clone() for p in host.params[update % 2]]  # W(update), still in use
        device.apply([t.clone() for t in grads], lr=1e-2)
        host.apply([t.clone() for t in grads], lr=1e-2)
        host.await_version(update + 1)
        assert all(torch.equal(a, b) for a, b in zip(host.params[update % 2], untouched, strict=True))
        for version in (update, update + 1):
            for a, b in zip(device.params[version % 2], host.params[version % 2], strict=True):
                assert torch.equal(a, b)
    weights, optimizer, previous = host.state()
    assert all(torch.equal(weights[n], t) for n, t in device.state()[0].items())
    reloaded = two_versions(HostVersions, cfg, device=torch.device("cpu"))
    reloaded.load_state(5, weights, optimizer, previous)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.params[1], host.params[1], strict=True))
    assert reloaded.host_bytes()["optimizer state"] >= 2 * reloaded.host_bytes()["master weights"]
    for versions in (host, reloaded):
        versions.close()


# ------------------------------------------------------------------ real gloo groups


def test_flush_with_offload_equals_the_plain_loop_gpt2_tied_two_stages_two_replicas(tmp_path):
    cfg = pipeline_cfg("gpt2", "strategy=pipe_flush", OFFLOAD, "strategy.stages=2", "strategy.replicas=2",
                       "strategy.microbatch_size=2", "strategy.num_microbatches=3", "optim=adamw", "optim.lr=1e-3")
    results, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, train_plain_loop(whole_minibatch_cfg(cfg), STEPS).hf_model)
    assert torch.equal(ours.transformer.wte.weight, ours.lm_head.weight)
    report = results["strategy_report"]
    assert report["offload"] == "host"
    for stage in report["per_stage"]:
        kept = stage["host_offload_bytes"]
        assert kept["master weights"] == 4 * stage["parameters"]
        assert 8 * stage["parameters"] <= kept["optimizer state"] <= 8 * stage["parameters"] + 4096  # AdamW: 2 moments
        assert stage["eps"]["updated_parameters"] > 0
    assert "stage host offload: masters + optimizer" in " ".join(report["summary"])


def test_flush_with_offload_equals_the_plain_loop_bert_three_stages(tmp_path):
    cfg = pipeline_cfg("bert", "model.num_layers=4", "strategy=pipe_flush", OFFLOAD, "strategy.stages=3",
                       "strategy.layout=[1,2,1]", "strategy.recompute=stage", "strategy.microbatch_size=2",
                       "strategy.num_microbatches=4", "optim=lamb", "optim.lr=1e-3")
    _, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, train_plain_loop(whole_minibatch_cfg(cfg), STEPS).hf_model)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_2bw_with_offload_equals_the_delayed_gradient_rule(tmp_path, family):
    optim = ["optim=sgd", "optim.momentum=0.9", "optim.lr=0.05"] if family == "gpt2" else ["optim=adamw", "optim.lr=1e-3"]
    cfg = pipeline_cfg(family, "strategy=pipe_2bw", OFFLOAD, "strategy.stages=2", "strategy.microbatch_size=2",
                       "strategy.num_microbatches=3", *optim)
    _, ours = trained_by_pipeline(cfg, tmp_path)
    assert_same_weights(ours, trained_by_delayed_gradients(cfg))
    if family == "gpt2":
        assert torch.equal(ours.transformer.wte.weight, ours.lm_head.weight)


@pytest.fixture(scope="module")
def offload_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("2bw-offload")
    finish(run_dir, *TWO_BW, OFFLOAD)
    return run_dir


# A kill and two resumes: make test-slow runs them (the default suite keeps to 15 min; the kill and
# exact resume of a pipeline is test_runtime_checkpoint's, of the EPS test_checkpoint's l2l case).
@pytest.mark.slow
@pytest.mark.parametrize("resume_with", ["host", "none"])
def test_2bw_with_offload_killed_resumes_exactly_with_or_without_offload(offload_reference, tmp_path, resume_with):
    """GPT-2 (tied weights on both stages), dropout on, killed after the checkpoint of an odd
    step: the newest version in the second device buffer, the master on the host."""
    run_dir, every = tmp_path / "run", ["train.checkpoint_every=7", "train.resume=auto"]
    proc = start(run_dir, *TWO_BW, OFFLOAD, *every)
    odd = checkpoint_dir(run_dir) / "step-00000021"
    wait_for(odd, proc)
    kill_group(proc)
    for later in checkpoint_dir(run_dir).glob("step-*"):
        if later.name > odd.name:
            shutil.rmtree(later)
    out = finish(run_dir, *TWO_BW, f"strategy.offload={resume_with}", *every)
    assert f"resuming from step 21 of {odd}\n" in out  # the same layout: an exact resume, RNG streams included
    assert_same_run(run_dir, offload_reference)


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_offload_is_the_device_optimizer_bit_for_bit(offload_reference, tmp_path):
    finish(tmp_path, *TWO_BW)
    ours, theirs = (load_file(d / "model" / "model.safetensors") for d in (offload_reference, tmp_path))
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


# ------------------------------------------------------------------ simulated device memory

MODEL = ["model=bert_tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.intermediate_size=1024", "model.vocab_size=2048", "data.seq_len=32", "optim=adamw",
         "strategy.stages=2", "strategy.num_microbatches=4", "strategy.microbatch_size=2"]


# pipe_flush's in the slow step (about 5 s each on 2 cores; the default suite stays within 8 minutes)
@pytest.mark.parametrize("strategy", [pytest.param("pipe_flush", marks=pytest.mark.slow), "pipe_2bw"])
def test_offload_takes_optimizer_state_off_the_device_in_a_dry_run(strategy):
    """Per stage: AdamW's two moments (8 bytes a parameter) leave the device; the working
    weights (one version, two under 2BW) and one gradient copy stay."""
    versions = 2 if strategy == "pipe_2bw" else 1
    figures = {}
    for offload in ("none", "host"):
        cfg = compose_config([*MODEL, f"strategy={strategy}", f"strategy.offload={offload}"])
        figures[offload] = simulate(cfg, steps=3).per_process
    for none, host in zip(figures["none"], figures["host"], strict=True):
        weights = none.by_kind["weights"]  # exact: every version's fp32 parameters
        # The breakdown is taken on the way to the peak, within 1 % of it (memory.SNAPSHOT_STEP).
        assert none.by_kind["optimizer state"] == pytest.approx(2 * weights / versions, rel=0.01)
        assert host.by_kind["optimizer state"] == 0
        assert host.by_kind["weights"] == weights
        assert host.by_kind["gradients"] <= 1.01 * none.by_kind["gradients"]
        assert host.peak_bytes <= none.peak_bytes - 0.99 * 2 * weights / versions


def test_the_stage_report_shows_its_simulated_device_peak(tmp_path):
    from relaytrain.run.train import run

    cfg = compose_config([*MODEL, "strategy=pipe_2bw", OFFLOAD, "train.device=meta", "train.steps=2",
                          "train.untimed_steps=0"])
    results = run(copy.deepcopy(cfg), tmp_path, quiet=True)
    stages = results["strategy_report"]["per_stage"]
    processes = results["memory"]["per_process"]
    assert [s["device_peak_bytes"] for s in stages] == [p["device"]["peak_allocated_bytes"] for p in processes]
    assert "stage device peak" in results["strategy_report"]["summary"]
