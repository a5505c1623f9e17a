"""Plain data parallelism: `strategy=baseline strategy.replicas=R` on real gloo process groups.

R workers, each on its share of every micro-batch, gradients summed by DistributedDataParallel
once per step: the weights equal the plain loop over the whole minibatch (clipping included),
evaluation sums every replica's rows, a checkpoint resumes bit for bit under the same replicas
and by name under another number of them, and the dry run simulates one worker's memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from relaytrain.models import build_model
from relaytrain.planner.dryrun import simulate
from relaytrain.records import checkpoint
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.conftest import TINY_BERT, tiny_cfg, train_plain_loop

STEPS = 3


def replicated_cfg(family: str, *overrides: str):
    return tiny_cfg(family, "strategy=baseline", "strategy.replicas=2", f"train.steps={STEPS}",
                    "train.save_model=true", "strategy.microbatch_size=2", "strategy.num_microbatches=3",
                    "strategy.timeout_s=60", *overrides)


def saved_model(cfg, run_dir):
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(run_dir / "model"))
    return build_model(saved.model).hf_model


def one_process(cfg):
    """The same run in one process over the whole minibatch (micro-batches R times larger)."""
    single = copy.deepcopy(cfg)
    OmegaConf.update(single, "strategy.replicas", 1)
    OmegaConf.update(single, "strategy.microbatch_size", cfg.strategy.microbatch_size * cfg.strategy.replicas)
    return single


@pytest.mark.parametrize(("family", "overrides"), [
    ("gpt2", ["optim.grad_clip=0.5"]),  # tied embedding and head; clipping sees the summed gradients
    ("bert", ["optim=sgd", "optim.momentum=0.9", "strategy.recompute=block", "data.eval_fraction=0.25"]),
])
def test_two_replicas_equal_the_plain_loop_over_the_whole_minibatch(family, overrides, tmp_path):
    cfg = replicated_cfg(family, *overrides)
    results = run(cfg, tmp_path / "dp")
    reference = train_plain_loop(one_process(cfg), STEPS).hf_model
    for (name, a), (_, b) in zip(saved_model(cfg, tmp_path / "dp").named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)
    assert results["processes"] == 2 and results["replicas"] == 2 and results["samples_per_step"] == 12
    if results["eval"]:  # every replica's rows, summed: the one-process evaluation's items
        single = run(one_process(cfg), tmp_path / "single")
        assert results["eval"][-1]["items"] == single["eval"][-1]["items"]
        assert results["eval"][-1]["loss"] == pytest.approx(single["eval"][-1]["loss"], rel=1e-5)


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_replicated_checkpoint_resumes_exactly_and_by_name_under_one_worker(tmp_path):
    cfg = replicated_cfg("bert", "train.checkpoint_every=1", "train.keep_checkpoints=0")
    run(cfg, tmp_path / "whole")
    step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "whole"), 1)
    again = replicated_cfg("bert", f"train.resume={step_one}")
    run(again, tmp_path / "again")
    for a, b in zip(saved_model(cfg, tmp_path / "whole").parameters(), saved_model(cfg, tmp_path / "again").parameters(),
                    strict=True):
        assert torch.equal(a, b)
    alone = one_process(replicated_cfg("bert", f"train.resume={step_one}"))
    run(alone, tmp_path / "alone")
    for a, b in zip(saved_model(cfg, tmp_path / "whole").parameters(), saved_model(cfg, tmp_path / "alone").parameters(),
                    strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_the_dry_run_simulates_each_worker_holding_the_whole_model():
    one, two = (simulate(compose_config([*TINY_BERT, "strategy=baseline", f"strategy.replicas={r}",
                                          "strategy.microbatch_size=4"])) for r in (1, 2))
    assert len(two.per_process) == 2
    assert all(p.by_kind["weights"] == one.per_process[0].by_kind["weights"] for p in two.per_process)
    assert two.peak_bytes == pytest.approx(one.peak_bytes, rel=0.01)  # the same b per worker: the same memory
