"""scripts/bench_long_context.py's memory comparison on a tiny shape: relaytrain (recompute=block,
its loss in chunks) and Trainer (gradient checkpointing, the whole sequence's logits) train the
same steps, so the peak ratio compares two ways of doing one training."""

import importlib
from pathlib import Path

import pytest

pytest.importorskip("accelerate")  # transformers.Trainer needs it (the dev and bench extras install it)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# The benchmark's long run, shrunk: a small vocabulary and a short sequence, and the loss in
# chunks of 16 tokens (auto would not chunk a vocabulary this small).
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.vocab_size=300", "model.max_seq_len=64",
        "data.seq_len=64", "data.num_samples=8", "model.loss_chunk_tokens=16"]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("bench_long_context")


def test_relaytrain_and_trainer_train_the_same_steps(bench, tmp_path):
    overrides = [*bench.LONG_RUN, *TINY]
    ours = bench.relaytrain_side(overrides, steps=3, run_dir=tmp_path / "relaytrain")
    theirs = bench.trainer_side(overrides, steps=3)
    assert theirs["optimizer_as_relaytrain"]
    assert len(ours["losses"]) == len(theirs["losses"]) == 3  # Trainer logged every step
    # Same model, samples and optimizer: the first step's loss agrees to float noise, and so do the
    # later ones (the gradients, chunked or whole, agreed too).
    assert theirs["losses"] == pytest.approx(ours["losses"], rel=bench.SAME_LOSS)
    assert ours["samples_per_s"] > 0 and theirs["samples_per_s"] > 0 and ours["host_peak_rss_bytes"] > 0


def test_the_peak_headline_is_lower_is_better(bench):
    def side(peak, loss):
        return {"peak_bytes": peak, "losses": [loss], "peak_of": "VmHWM"}

    rounds = [{"relaytrain": side(1, 5.0), "hf_trainer": side(4, 5.0)},
              {"relaytrain": side(3, 5.0), "hf_trainer": side(4, 5.0 + 1e-6)},
              {"relaytrain": side(1, 5.0), "hf_trainer": side(2, 5.0)}]
    result = bench.peak_comparison(rounds)
    h = result["headline"]
    assert h["rounds"] == [0.25, 0.75, 0.5] and h["median"] == 0.5 and h["best"] == 0.25
    assert h["lower_is_better"] and h["target"] == bench.PEAK_TARGET
    assert result["same_first_step_loss"]
    rounds[1]["hf_trainer"]["losses"] = [5.1]
    assert not bench.peak_comparison(rounds)["same_first_step_loss"]
