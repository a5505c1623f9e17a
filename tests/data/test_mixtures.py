"""data.mix: several record sets, each in its own form and shape, drawn by weight with a seeded
generator, each part's counts in results.json; and the keys refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from relaytrain.commands.cli import main
from relaytrain.data import build_datasets
from relaytrain.data.mixture import shares
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import chat_tokenizer, tiny_decoder
from tests.data.test_record_forms import as_messages, as_sharegpt, write_form


def test_shares_follow_the_weights_and_add_up():
    assert shares([3.0, 1.0], 16) == [12, 4]
    assert shares([1.0, 1.0, 1.0], 10) == [4, 3, 3]
    assert sum(shares([0.7, 0.2, 0.1], 101)) == 101


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A ShareGPT parquet file of 8 conversations whose replies say "A", a messages JSON lines file
    of 8 whose replies say "B", and a tiny llama."""
    root = tmp_path_factory.mktemp("mix")
    (root / "a").mkdir()
    (root / "b").mkdir()
    a = write_form("parquet", [as_sharegpt([("user", f"Question {i}?"), ("assistant", "A")]) for i in range(8)],
                   root / "a")
    b = write_form("jsonl", [as_messages([("user", f"Question {i}?"), ("assistant", "B")]) for i in range(8)],
                   root / "b")
    return a, b, tiny_decoder(root / "llama", layers=2)


def mix_cfg(parts, *overrides: str, weights=(3, 1)):
    a, b, llama = parts
    mix = f"data.mix=[{{path: {a}, weight: {weights[0]}}}, {{path: {b}, weight: {weights[1]}}}]"
    return resolve(compose_config([f"model.pretrained={llama}", "data=chat", mix, "data.seq_len=32",
                                   "strategy.microbatch_size=2", "strategy.num_microbatches=2", "train.steps=2",
                                   "train.untimed_steps=1", "data.cache=false", *overrides]))


def replies(dataset) -> list[str]:
    return [chat_tokenizer().decode(row[row != -100].tolist()) for row in dataset.labels]


def test_a_two_source_mixture_draws_by_weight_seeded_and_reports_each_part(parts, tmp_path):
    train = build_datasets(mix_cfg(parts))[0]
    said = [reply[0] for reply in replies(train)]
    assert said.count("A") == 12 and said.count("B") == 4 and said[:12] != ["A"] * 12  # interleaved
    a, b, _ = parts
    assert train.facts["mix"] == [{"path": a, "weight": 3.0, "records": 8, "drawn": 12},
                                  {"path": b, "weight": 1.0, "records": 8, "drawn": 4}]
    again = build_datasets(mix_cfg(parts))[0]
    assert torch.equal(again.input_ids, train.input_ids)
    other = build_datasets(mix_cfg(parts, "data.seed=5"))[0]
    assert not torch.equal(other.input_ids, train.input_ids)
    results = run(mix_cfg(parts), tmp_path, quiet=True)
    assert [part["drawn"] for part in results["data"]["mix"]] == [12, 4] and results["steps"] == 2


@pytest.mark.parametrize("overrides, message", [
    (["data.path=/tmp/x.jsonl"], "data.path and data.mix both name the training records"),
    (["data.mix=[{path: /tmp/x.jsonl, weight: 0}]"], r"data.mix\[0\].weight=0.0 must be positive and finite"),
    (["data.mix=[{path: /nowhere/x.parquet}]"], r"data.mix\[0\].path=/nowhere/x.parquet does not exist"),
    (["data.streaming=true"], "data.streaming=true cannot take data.mix"),
], ids=["path-and-mix", "zero-weight", "missing-part", "streaming"])
def test_mixture_and_streaming_keys_are_refused_in_one_line(parts, overrides, message):
    cfg = mix_cfg(parts, *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize("weights, message", [
    ((1, -0.5), r"^data.mix\[1\].weight=-0.5 must be positive and finite"),
    ((0, 0), r"^data.mix\[0\].weight=0.0 must be positive and finite"),
    ((1, "inf"), r"^data.mix\[1\].weight=inf must be positive and finite"),
    pytest.param((1, 1e-9), r"^data.mix\[1\].weight=1e-09 draws none of its 8 records \(of 16 drawn in all\); "
                 r"raise its weight", marks=pytest.mark.slow),  # found reading the parts: the run starts first
], ids=["negative", "summing-to-zero", "infinite", "drawing-nothing"])
def test_a_weight_that_draws_no_share_is_one_line_from_the_command_and_the_api(parts, tmp_path, capsys, weights,
                                                                               message):
    """Through `relaytrain train` (one line, exit 2) and through `build_datasets` without the
    config checks (the same line, not a ZeroDivisionError or a part drawn a negative count)."""
    cfg = mix_cfg(parts, weights=weights)
    cfg.data.mix[0].weight, cfg.data.mix[1].weight = weights  # as given: the API takes what it is handed
    with pytest.raises(ConfigError, match=message):
        build_datasets(cfg)
    a, b, llama = parts
    mix = f"data.mix=[{{path: {a}, weight: {weights[0]}}}, {{path: {b}, weight: {weights[1]}}}]"
    try:
        code = main(["train", f"model.pretrained={llama}", "data=chat", mix, "data.seq_len=32", "data.cache=false",
                     f"hydra.run.dir={tmp_path}"])
    except SystemExit as stop:  # a problem found once the run has started leaves through Hydra
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.search(message.replace("^", "^relaytrain: error: "), err[0]), err


def test_shares_of_huge_weights_do_not_overflow():
    assert shares([1e308, 1e308], 10) == [5, 5]


def test_a_mixture_is_refused_for_a_source_that_reads_one_dataset(parts):
    a, _, _ = parts
    cfg = compose_config(["data=glue", f"data.mix=[{{path: {a}}}]"])
    with pytest.raises(ConfigError, match="data.mix mixes record sets for data=chat or jsonl or preference or prompts; data=glue"):
        validate(cfg)
