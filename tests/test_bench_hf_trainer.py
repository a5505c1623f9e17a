"""scripts/bench_hf_trainer.py end to end on a tiny BERT: both contestants train the same steps."""

import importlib
from pathlib import Path

import pytest

from tests.conftest import TINY_BERT

pytest.importorskip("accelerate")  # transformers.Trainer needs it (the dev and bench extras install it)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the contestants' spawned processes inherit it
    return importlib.import_module("bench_hf_trainer")


def test_relaytrain_and_trainer_train_the_same_steps(bench):
    result = bench.compare(TINY_BERT, rounds=1, steps=2, warmup=0)
    (figures,) = result["rounds"]
    ours, theirs = figures["relaytrain"], figures["hf_trainer"]
    assert ours["samples_per_s"] > 0 and theirs["samples_per_s"] > 0
    assert len(ours["step_times_s"]) == len(theirs["step_times_s"]) == 2
    assert ours["peak_rss_bytes"] > 0 and theirs["peak_rss_bytes"] > 0
    h = result["headlines"]["baseline_vs_hf_trainer"]
    assert h["rounds"] == [ours["samples_per_s"] / theirs["samples_per_s"]] and h["target"] == bench.TARGET
    # The same training: with dropout off (the tiny config), the same model, samples, order and
    # optimizer give the same losses.
    assert theirs["optimizer_as_relaytrain"]
    assert theirs["mean_loss"] == pytest.approx(ours["mean_loss"], rel=1e-5)
    assert theirs["threads"] == ours["threads"]


def test_a_setting_trainer_would_not_reproduce_is_refused(bench):
    with pytest.raises(SystemExit, match="optim.name=sgd is not compared"):
        bench.compare([*TINY_BERT, "optim=sgd"], rounds=1, steps=2, warmup=0)
