"""data.streaming: records read and tokenized as they are trained on. In order a streamed run
trains on the in-memory run's rows (to its weights); stopped at a checkpoint and resumed, through
a shuffle buffer, it ends where the uninterrupted run does; what a stream cannot do is one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.compose import compose_config, validate
from relaytrain.data import build_datasets, build_loader
from relaytrain.errors import ConfigError
from relaytrain.models.pretrained import resolve
from relaytrain.train import run
from tests.checkpoints import tiny_decoder
from tests.data.test_data_sources import sentence


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """10 text records in JSON lines (a blank line after the third) and a tiny llama with its tokenizer."""
    root = tmp_path_factory.mktemp("stream")
    lines = [json.dumps({"text": sentence(i)}) for i in range(10)]
    (root / "corpus.jsonl").write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")
    return root / "corpus.jsonl", tiny_decoder(root / "llama", layers=2)


def stream_cfg(corpus, *overrides: str):
    path, llama = corpus
    return resolve(compose_config([f"model.pretrained={llama}", "model.task=causal_lm", "data=jsonl",
                                   f"data.path={path}", "data.seq_len=16", "strategy.microbatch_size=2",
                                   "strategy.num_microbatches=2", "train.untimed_steps=1", "train.save_model=true",
                                   "optim.lr=1e-2", "data.cache=false", *overrides]))


def weights(run_dir) -> dict:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_in_order_a_streamed_run_trains_to_the_in_memory_runs_weights(corpus, tmp_path):
    """10 records in minibatches of 4: 2 a pass, the last 2 records dropped, as in memory; 3 steps
    cross into the second pass."""
    ordered = ["data.shuffle=false", "train.steps=3"]
    in_memory = run(stream_cfg(corpus, *ordered), tmp_path / "memory", quiet=True)
    streamed = run(stream_cfg(corpus, *ordered, "data.streaming=true"), tmp_path / "stream", quiet=True)
    assert streamed["loss"] == pytest.approx(in_memory["loss"], rel=1e-5)
    assert_same_weights(weights(tmp_path / "memory"), weights(tmp_path / "stream"))
    assert streamed["data"]["streaming"] and streamed["data"]["cache"] == "off"


def test_a_streamed_run_stopped_and_resumed_ends_as_the_uninterrupted_one(corpus, tmp_path):
    """Stopped after the first pass (2 steps), resumed to the end of the second: the resumed run
    replays the first pass's buffer draws to find where the second starts."""
    shuffled = ["data.shuffle=true", "data.shuffle_buffer=3", "data.streaming=true", "train.checkpoint_every=2"]
    run(stream_cfg(corpus, *shuffled, "train.steps=4"), tmp_path / "whole", quiet=True)
    run(stream_cfg(corpus, *shuffled, "train.steps=2"), tmp_path / "parts", quiet=True)
    resumed = run(stream_cfg(corpus, *shuffled, "train.steps=4", "train.resume=auto"), tmp_path / "parts", quiet=True)
    assert resumed["steps"] == 4
    assert_same_weights(weights(tmp_path / "whole"), weights(tmp_path / "parts"))


def test_the_buffer_shuffles_each_pass_its_own_way_from_the_seed(corpus):
    cfg = stream_cfg(corpus, "data.streaming=true", "data.shuffle_buffer=3")
    loader = build_loader(cfg, build_datasets(cfg)[0])
    first_pass = [mb.input_ids for p in range(2) for mb in loader.minibatch(p)]
    second_pass = [mb.input_ids for p in range(2, 4) for mb in loader.minibatch(p)]
    again = build_loader(cfg, build_datasets(cfg)[0])
    assert all(torch.equal(a, b) for a, b in zip(first_pass, [mb.input_ids for p in range(2) for mb in
                                                              again.minibatch(p)], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first_pass, second_pass, strict=True))


def test_a_bad_record_names_its_file_and_line_when_the_stream_reaches_it(corpus, tmp_path):
    path, _ = corpus
    lines = path.read_text().splitlines()
    lines[6] = json.dumps({"txt": "a misspelt field"})
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    cfg = stream_cfg(corpus, "data.streaming=true", "data.shuffle=false", f"data.path={tmp_path / 'bad.jsonl'}")
    loader = build_loader(cfg, build_datasets(cfg)[0])
    loader.minibatch(0)  # records 1-4: fine
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'bad.jsonl'} line 7: no 'text' text"):
        loader.minibatch(1)  # records 5-8; the 6th is on line 7, after the blank line 4


@pytest.mark.parametrize("overrides, message", [
    (["data=chat"], "data.streaming=true streams data=jsonl records; data=chat reads its whole set"),
    (["data.eval_fraction=0.1"], "data.streaming=true cannot take data.eval_fraction"),
    (["model.pretrained=null", "model=bert_tiny", "model.task=masked_lm"], "cannot take model.task=masked_lm"),
    (["model.pretrained=null", "model=gpt2_tiny"], "needs a tokenizer made beforehand"),
], ids=["chat", "eval-fraction", "masked-lm", "no-tokenizer"])
def test_what_a_stream_cannot_do_is_one_line(corpus, overrides, message):
    path, llama = corpus
    base = ["data=jsonl", f"data.path={path}", "data.streaming=true", f"model.pretrained={llama}", "data.seq_len=32"]
    cfg = compose_config([*base, *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(resolve(cfg) if cfg.model.pretrained else cfg)


def test_a_stream_shorter_than_a_minibatch_is_refused_before_training(corpus, tmp_path):
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "one record"}) + "\n")
    cfg = stream_cfg(corpus, "data.streaming=true", f"data.path={tmp_path / 'short.jsonl'}")
    with pytest.raises(ConfigError, match="holds 1 records, fewer than one minibatch"):
        build_loader(cfg, build_datasets(cfg)[0])
