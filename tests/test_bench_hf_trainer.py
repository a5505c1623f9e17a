"""scripts/bench_hf_trainer.py end to end on a tiny BERT and a tiny Llama-layout decoder: both
contestants train the same steps."""

import importlib
from pathlib import Path

import pytest

from tests.conftest import TINY_BERT

pytest.importorskip("accelerate")  # transformers.Trainer needs it (the dev and bench extras install it)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TINY_DECODER = [
    "model=llama_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=64", "model.vocab_size=300", "data.seq_len=16", "data.num_samples=256",
]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the contestants' spawned processes inherit it
    return importlib.import_module("bench_hf_trainer")


@pytest.mark.slow  # ~25 s on 2 cores: the slow step (the default suite stays within 8 minutes)
@pytest.mark.parametrize(("name", "overrides"), [("baseline_vs_hf_trainer", TINY_BERT),
                                                  pytest.param("decoder_baseline_vs_hf_trainer", TINY_DECODER,
                                                               marks=pytest.mark.slow)])
def test_relaytrain_and_trainer_train_the_same_steps(bench, name, overrides):
    assert name in bench.DEFAULT and name in bench.QUICK  # a comparison the script runs, under this headline
    result = bench.compare(name, overrides, rounds=1, steps=2, warmup=0)
    (figures,) = result["rounds"]
    ours, theirs = figures["relaytrain"], figures["hf_trainer"]
    assert ours["samples_per_s"] > 0 and theirs["samples_per_s"] > 0
    assert len(ours["step_times_s"]) == len(theirs["step_times_s"]) == 2
    assert ours["peak_rss_bytes"] > 0 and theirs["peak_rss_bytes"] > 0
    assert list(result["headlines"]) == [name]
    h = result["headlines"][name]
    assert h["rounds"] == [ours["samples_per_s"] / theirs["samples_per_s"]] and h["target"] == bench.TARGET
    # The same training: with dropout off (the tiny configs), the same model, samples, order and
    # optimizer give the same losses (the decoder's: both average over the minibatch's shifted labels).
    assert theirs["optimizer_as_relaytrain"]
    assert theirs["mean_loss"] == pytest.approx(ours["mean_loss"], rel=1e-5)
    assert theirs["threads"] == ours["threads"]


def test_a_setting_trainer_would_not_reproduce_is_refused(bench):
    with pytest.raises(SystemExit, match="optim.name=sgd is not compared"):
        bench.compare("baseline_vs_hf_trainer", [*TINY_BERT, "optim=sgd"], rounds=1, steps=2, warmup=0)
