"""scripts/deepspeed_contestant.py, the GPU bench's Trainer + DeepSpeed ZeRO-3 offload contestant:
on the CPU it trains the steps relaytrain's baseline trains, with DeepSpeed's own host Adam."""

import importlib

import pytest

from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.conftest import needs_extra
from tests.test_bench_hf_trainer import SCRIPTS, TINY_DECODER

pytestmark = [*needs_extra("deepspeed", "fast"), *needs_extra("accelerate", "dev")]

KEYS = [*TINY_DECODER, "data.num_samples=64", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
        "train.steps=3", "train.device=cpu"]


def test_the_contestant_trains_relaytrains_steps_with_deepspeeds_host_adam(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the contestant's spawned process inherits it
    contestant = importlib.import_module("deepspeed_contestant")
    theirs = contestant.measure(KEYS, warmup=1, cpu=True)
    ours = run(compose_config([*KEYS, "train.untimed_steps=1"]), tmp_path / "run", quiet=True)
    assert theirs["optimizer"] == "DeepSpeedCPUAdam"
    assert theirs["parameters"] == ours["model"]["parameters"]
    assert len(theirs["step_times_s"]) == 3 - 1 and theirs["samples_per_s"] > 0  # the steps after the warm-up
    # the same first loss (the same weights and rows); then AdamW's two kernels differ in rounding
    assert theirs["losses"] == pytest.approx(ours["loss"], rel=1e-5)
