"""FSDP (`strategy=fsdp`, torch's fully_shard) on real gloo process groups.

Two workers each holding half of every tensor: the weights equal the plain loop over the whole
minibatch (a tied GPT-2 with clipping; a BERT without resharding, with block recompute and SGD
momentum; LAMB's per-tensor trust ratio across shards), a checkpoint written with
torch.distributed.checkpoint resumes exactly on two workers, by name on one (DCP reshards) and
under the baseline, a baseline checkpoint resumes under FSDP, offload is refused on a CPU, and
the dry run reports a worker's memory by FSDP's closed form, labelled so.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from relaytrain.commands.cli import main
from relaytrain.models import build_model
from relaytrain.planner.dryrun import simulate
from relaytrain.records import checkpoint
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.conftest import TINY_BERT, tiny_cfg, train_plain_loop

STEPS = 3


def fsdp_cfg(family: str, *overrides: str):
    return tiny_cfg(family, "strategy=fsdp", f"train.steps={STEPS}", "train.save_model=true",
                    "strategy.microbatch_size=2", "strategy.num_microbatches=3", "strategy.timeout_s=60", *overrides)


def saved_model(cfg, run_dir):
    saved = copy.deepcopy(cfg)
    OmegaConf.update(saved, "model.pretrained", str(run_dir / "model"))
    return build_model(saved.model).hf_model


def whole_minibatch(cfg, strategy: str = "baseline"):
    """The same run in one process over the whole minibatch."""
    single = copy.deepcopy(cfg)
    replicas = cfg.strategy.replicas
    OmegaConf.update(single, "strategy.name", strategy)
    OmegaConf.update(single, "strategy.replicas", 1)
    OmegaConf.update(single, "strategy.microbatch_size", cfg.strategy.microbatch_size * replicas)
    return single


def assert_same(a, b, exact: bool = False):
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if exact:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("family", "overrides"), [
    ("gpt2", ["optim.grad_clip=0.5"]),
    ("bert", ["optim=sgd", "optim.momentum=0.9", "strategy.reshard_after_forward=false", "strategy.recompute=block"]),
    pytest.param("bert", ["optim=lamb", "data.eval_fraction=0.25"], marks=pytest.mark.slow),  # over 6 s: the slow step
])
def test_two_workers_equal_the_plain_loop_over_the_whole_minibatch(family, overrides, tmp_path):
    cfg = fsdp_cfg(family, *overrides)
    results = run(cfg, tmp_path / "fsdp")
    assert_same(saved_model(cfg, tmp_path / "fsdp"), train_plain_loop(whole_minibatch(cfg), STEPS).hf_model)
    assert results["processes"] == 2 and "2 workers" in results["strategy_report"]["summary"]["shards"]
    if results["eval"]:  # both workers' rows, summed
        single = run(whole_minibatch(cfg), tmp_path / "single")
        assert results["eval"][-1]["items"] == single["eval"][-1]["items"]
        assert results["eval"][-1]["loss"] == pytest.approx(single["eval"][-1]["loss"], rel=1e-5)


@pytest.mark.slow  # over 4 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_a_sharded_checkpoint_resumes_exactly_on_two_workers_and_by_name_elsewhere(tmp_path):
    cfg = fsdp_cfg("gpt2", "train.checkpoint_every=1", "train.keep_checkpoints=0")
    run(cfg, tmp_path / "whole")
    step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "whole"), 1)
    assert (step_one / "sharded" / ".metadata").is_file()  # torch.distributed.checkpoint's own layout
    assert checkpoint.is_complete(step_one)
    final = saved_model(cfg, tmp_path / "whole")
    resumed = {
        "two workers": fsdp_cfg("gpt2", f"train.resume={step_one}"),
        "one worker": fsdp_cfg("gpt2", f"train.resume={step_one}", "strategy.replicas=1", "strategy.microbatch_size=4"),
        "the baseline": whole_minibatch(fsdp_cfg("gpt2", f"train.resume={step_one}")),
    }
    for name, again in resumed.items():
        run(again, tmp_path / name.replace(" ", "_"))
        assert_same(final, saved_model(cfg, tmp_path / name.replace(" ", "_")), exact=name == "two workers")


def test_a_baseline_checkpoint_resumes_under_fsdp(tmp_path):
    baseline = whole_minibatch(fsdp_cfg("gpt2", "train.checkpoint_every=1", "train.keep_checkpoints=0"))
    run(baseline, tmp_path / "baseline")
    step_one = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "baseline"), 1)
    sharded = fsdp_cfg("gpt2", f"train.resume={step_one}")
    run(sharded, tmp_path / "fsdp")
    assert_same(saved_model(baseline, tmp_path / "baseline"), saved_model(sharded, tmp_path / "fsdp"))


def test_offload_on_a_cpu_is_refused_in_one_line(capsys):
    assert main(["train", *TINY_BERT, "strategy=fsdp", "strategy.offload=host", "train.device=cpu"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "strategy.offload=host" in line and "use strategy.offload=none" in line


def test_the_dry_run_shards_the_state_by_its_closed_form():
    base = [*TINY_BERT, "strategy.microbatch_size=4", "strategy.num_microbatches=2"]
    baseline = simulate(compose_config([*base, "strategy=baseline"]))
    sharded = simulate(compose_config([*base, "strategy=fsdp", "strategy.replicas=2"]))
    whole, half = baseline.per_process[0].by_kind, sharded.per_process[0].by_kind
    assert len(sharded.per_process) == 2
    for kind in ("weights", "gradients", "optimizer state"):
        assert half[kind] == whole[kind] // 2
    assert half["parameters gathered"] > 0 and sharded.peak_bytes < baseline.peak_bytes
    kept = simulate(compose_config([*base, "strategy=fsdp", "strategy.reshard_after_forward=false"]))
    assert kept.per_process[0].by_kind["parameters gathered"] > half["parameters gathered"]


@pytest.mark.parametrize("reshard, gathers_per_unit", [(True, 2 * 4), (False, 1)])
def test_without_resharding_a_step_gathers_once_not_once_per_micro_batch(reshard, gathers_per_unit, monkeypatch,
                                                                         tmp_path):
    """4 micro-batches a step: ZeRO-3 gathers every unit twice per micro-batch; without
    resharding the parameters stay gathered across the step's micro-batches (one gather).
    Counted where FSDP starts an all-gather (one worker: the same decisions, no peer)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    calls = []
    unshard = FSDPParamGroup.unshard

    def counted(group, *args, **kwargs):
        idle = group._all_gather_result is None
        unshard(group, *args, **kwargs)
        calls.extend([1] if idle and group._all_gather_result is not None else [])

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    cfg = tiny_cfg("bert", "strategy=fsdp", "strategy.replicas=1", "strategy.microbatch_size=2",
                   "strategy.num_microbatches=4",
                   f"strategy.reshard_after_forward={str(reshard).lower()}", "train.steps=1",
                   "train.save_model=false", "train.checkpoint_every=0")
    run(cfg, tmp_path, quiet=True)
    units = cfg.model.num_layers + 1  # every block, and the root
    assert len(calls) == gathers_per_unit * units


def test_a_resume_leaves_a_parameter_without_optimizer_state_as_the_uninterrupted_run_does(monkeypatch, tmp_path):
    """One tensor gets no gradient in the first two steps, so the step-2 checkpoint holds no
    AdamW state for it; after the resume its first update must count as its first (step 1 in
    the bias correction), as in the run that was never interrupted: the weights end equal."""
    from relaytrain.strategies.baseline import Baseline
    from relaytrain.strategies.fsdp import Fsdp

    frozen = "blocks.2.layer.ln_2.bias"  # the layered model's name for the last block's second norm's bias

    def start(self, step):
        self.steps_done = step

    def update(self, lr):
        self.steps_done += 1
        if self.steps_done <= 2:
            dict(self.net.model.named_parameters())[frozen].grad = None
        return Baseline._update(self, lr)

    monkeypatch.setattr(Fsdp, "start", start)
    monkeypatch.setattr(Fsdp, "_update", update)
    one = ("strategy.replicas=1", "strategy.microbatch_size=4", "train.steps=4")
    cfg = fsdp_cfg("gpt2", *one, "train.checkpoint_every=1", "train.keep_checkpoints=0")
    run(cfg, tmp_path / "whole")
    step_two = checkpoint.step_dir(checkpoint.checkpoint_dir(tmp_path / "whole"), 2)
    run(fsdp_cfg("gpt2", *one, f"train.resume={step_two}"), tmp_path / "resumed")
    assert_same(saved_model(cfg, tmp_path / "whole"), saved_model(cfg, tmp_path / "resumed"), exact=True)
