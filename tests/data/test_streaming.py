"""data.streaming: records read and tokenized as they are trained on, text (jsonl) and chat
alike. In order a streamed run trains on the in-memory run's rows (to its weights); stopped at a
checkpoint and resumed, through a shuffle buffer, it ends where the uninterrupted run does; what
a stream cannot do is one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.data import build_datasets, build_loader
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config, validate
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
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
    (["data=synthetic"], "data.streaming=true streams data=chat or jsonl records; data=synthetic reads its whole set"),
    (["data.eval_fraction=0.1"], "data.streaming=true cannot take data.eval_fraction"),
    (["model.pretrained=null", "model=bert_tiny", "model.task=masked_lm"], "cannot take model.task=masked_lm"),
    (["model.pretrained=null", "model=gpt2_tiny"], "needs a tokenizer made beforehand"),
], ids=["synthetic", "eval-fraction", "masked-lm", "no-tokenizer"])
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


# --------------------------------------------------------------------------- chat


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory):
    """18 conversations in JSON lines (a blank line after the fifth): most short, every fifth with
    a reply longer than data.seq_len=40 (cut), every seventh with a prompt longer (dropped); a
    held-out file of 3; a tiny llama with its ChatML tokenizer."""
    root = tmp_path_factory.mktemp("chat_stream")
    records = [_conversation(i) for i in range(18)]
    lines = [json.dumps(record) for record in records]
    (root / "chat.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    (root / "eval.jsonl").write_text("".join(json.dumps(_conversation(i)) + "\n" for i in (1, 2, 3)))
    return root / "chat.jsonl", root / "eval.jsonl", tiny_decoder(root / "llama", layers=2)


def _conversation(i: int) -> dict:
    prompt = f"What is {i} plus two?" + (" Tell me with care." * 8 if i % 7 == 6 else "")
    reply = f"It is {i + 2}." + (" The quick brown fox jumps over the lazy dog." * 3 if i % 5 == 4 else "")
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}


def chat_stream_cfg(chat_corpus, *overrides: str):
    path, held_out, llama = chat_corpus
    return resolve(compose_config([f"model.pretrained={llama}", "data=chat", f"data.path={path}", "data.seq_len=40",
                                   "strategy.microbatch_size=2", "strategy.num_microbatches=2", "train.untimed_steps=1",
                                   "train.save_model=true", "optim.lr=1e-2", "data.cache=false", *overrides]))


def assert_same_minibatch(streamed: list, in_memory: list) -> None:
    """The same rows: ids, labels and positions equal; the stream's mask is the whole set's (ones
    where the whole set has none and the minibatch is unpacked)."""
    for s, m in zip(streamed, in_memory, strict=True):
        assert torch.equal(s.input_ids, m.input_ids) and torch.equal(s.labels, m.labels) and s.draw == m.draw
        assert (s.position_ids is None) == (m.position_ids is None)
        assert s.position_ids is None or torch.equal(s.position_ids, m.position_ids)
        if m.attention_mask is not None:
            assert torch.equal(s.attention_mask, m.attention_mask)


@pytest.mark.parametrize("pack", [False, True], ids=["one-a-row", "packed"])
def test_in_order_a_chat_stream_serves_the_in_memory_sets_minibatches_and_a_jump_the_same(chat_corpus, pack):
    """Over three passes: records cut and dropped past data.seq_len and packed exactly as the whole
    set's; a fresh loader asked for a later position (a resume) serves what the first served."""
    in_memory_cfg = chat_stream_cfg(chat_corpus, "data.shuffle=false", f"data.pack={pack}")
    whole = build_datasets(in_memory_cfg)[0]
    assert whole.facts["truncated"] > 0 and whole.facts["dropped"] > 0
    memory = build_loader(in_memory_cfg, whole)
    cfg = chat_stream_cfg(chat_corpus, "data.shuffle=false", f"data.pack={pack}", "data.streaming=true")
    stream = build_loader(cfg, build_datasets(cfg)[0])
    passes = 3 * memory.minibatches_per_epoch
    served = [stream.minibatch(p) for p in range(passes)]
    for position, streamed in enumerate(served):
        assert_same_minibatch(streamed, memory.minibatch(position))
    jumped = build_loader(cfg, build_datasets(cfg)[0])
    assert_same_minibatch(jumped.minibatch(passes - 2), served[passes - 2])
    assert_same_minibatch(jumped.minibatch(passes - 1), served[passes - 1])


def test_a_shuffled_chat_stream_resumes_where_it_was(chat_corpus):
    """Through the shuffle buffer: a fresh loader jumping to a position in the second pass serves
    the rows the uninterrupted loader served there (the buffer's draws replayed)."""
    cfg = chat_stream_cfg(chat_corpus, "data.streaming=true", "data.shuffle=true", "data.shuffle_buffer=5",
                          "data.pack=true")
    stream = build_loader(cfg, build_datasets(cfg)[0])
    served = [stream.minibatch(p) for p in range(6)]
    jumped = build_loader(cfg, build_datasets(cfg)[0])
    for position in (4, 5):
        assert_same_minibatch(jumped.minibatch(position), served[position])
    in_order = chat_stream_cfg(chat_corpus, "data.streaming=true", "data.shuffle=false", "data.pack=true")
    first_in_order = build_loader(in_order, build_datasets(in_order)[0]).minibatch(0)
    assert not all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(served[0], first_in_order, strict=True))


def test_a_chat_stream_of_several_forms_names_both_records_when_it_reaches_the_other(chat_corpus, tmp_path):
    path, _, _ = chat_corpus
    lines = path.read_text().splitlines()
    lines[9] = json.dumps({"instruction": "Say hi.", "output": "Hi."})
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    cfg = chat_stream_cfg(chat_corpus, "data.streaming=true", "data.shuffle=false",
                          f"data.path={tmp_path / 'mixed.jsonl'}")
    loader = build_loader(cfg, build_datasets(cfg)[0])
    loader.minibatch(0)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'mixed.jsonl'} line 10 holds a record of the alpaca form, "
                                          rf"{tmp_path / 'mixed.jsonl'} line 1 one of the messages form"):
        loader.minibatch(1)


@pytest.mark.slow  # four runs
@pytest.mark.parametrize("pack", [False, True], ids=["one-a-row", "packed"])
def test_in_order_a_streamed_chat_run_trains_to_the_in_memory_runs_weights(chat_corpus, tmp_path, pack):
    """Into the second pass, held-out records evaluated alike."""
    _, held_out, _ = chat_corpus
    ordered = ["data.shuffle=false", f"data.pack={pack}", "train.steps=5", f"data.eval_path={held_out}"]
    in_memory = run(chat_stream_cfg(chat_corpus, *ordered), tmp_path / "memory", quiet=True)
    streamed = run(chat_stream_cfg(chat_corpus, *ordered, "data.streaming=true"), tmp_path / "stream", quiet=True)
    assert streamed["loss"] == pytest.approx(in_memory["loss"], rel=1e-5)
    assert len(streamed["eval"]) == len(in_memory["eval"]) == 1
    assert streamed["eval"][0]["loss"] == pytest.approx(in_memory["eval"][0]["loss"], rel=1e-5)
    assert_same_weights(weights(tmp_path / "memory"), weights(tmp_path / "stream"))
    assert streamed["data"]["streaming"] and streamed["data"]["source"] == "chat"


@pytest.mark.slow  # three runs
def test_a_streamed_chat_run_stopped_and_resumed_ends_as_the_uninterrupted_one(chat_corpus, tmp_path):
    shuffled = ["data.shuffle=true", "data.shuffle_buffer=5", "data.streaming=true", "train.checkpoint_every=2"]
    run(chat_stream_cfg(chat_corpus, *shuffled, "train.steps=6"), tmp_path / "whole", quiet=True)
    run(chat_stream_cfg(chat_corpus, *shuffled, "train.steps=4"), tmp_path / "parts", quiet=True)
    resumed = run(chat_stream_cfg(chat_corpus, *shuffled, "train.steps=6", "train.resume=auto"), tmp_path / "parts",
                  quiet=True)
    assert resumed["steps"] == 6
    assert_same_weights(weights(tmp_path / "whole"), weights(tmp_path / "parts"))
