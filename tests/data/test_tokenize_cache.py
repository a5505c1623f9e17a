"""The tokenize cache: a set is tokenized once and read back while nothing it depends on changes;
a changed input, tokenizer or data key misses; several processes of one run prepare it once;
results.json's `data` says what happened, and the summary table shows it."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relaytrain.data import build_datasets, cache
from relaytrain.data.cache import default_dir as unpatched_default_dir  # conftest patches cache.default_dir
from relaytrain.data.chat import encode_records, read_conversations
from relaytrain.data.reading import read_records
from relaytrain.data.sources import source
from relaytrain.models.family import family_spec
from relaytrain.models.pretrained import resolve
from relaytrain.objectives import objective
from relaytrain.records.display import data_rows
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from tests.checkpoints import chat_tokenizer, tiny_decoder

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FRESH_LLAMA = ["model=llama_tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
               "model.intermediate_size=64", "model.vocab_size=400", "model.dropout=0.0"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_decoder(tmp_path_factory.mktemp("cache") / "llama", layers=2)


def chat_cfg(*overrides: str):
    return compose_config([*FRESH_LLAMA, "data=chat", f"data.path={EXAMPLES / 'chat.jsonl'}", "data.seq_len=64",
                           "strategy.microbatch_size=2", "strategy.num_microbatches=2", "train.steps=2",
                           "train.untimed_steps=1", "train.save_model=true", *overrides])


def entry_key(cfg) -> dict:
    """The tokenize cache's key of a data=chat run of `cfg`, as `build_datasets` makes it."""
    chat = source("chat")
    return cache.cache_key(cfg, chat.inputs(cfg), chat.chat_template, objective(cfg.model.task),
                           family_spec(cfg.model.family))


def weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "model" / "model.safetensors"))


def test_two_identical_runs_miss_then_hit_with_equal_weights_and_a_changed_seq_len_misses(tmp_path):
    """A fresh model: the tokenizer is trained on the records at the miss and comes from the cache at the hit."""
    cache_dir = f"data.cache_dir={tmp_path / 'cache'}"
    first = run(chat_cfg(cache_dir), tmp_path / "first", quiet=True)
    second = run(chat_cfg(cache_dir), tmp_path / "second", quiet=True)
    assert (first["data"]["cache"], second["data"]["cache"]) == ("miss", "hit")
    assert first["loss"] == second["loss"]
    a, b = weights(tmp_path / "first"), weights(tmp_path / "second")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    for run_dir in ("first", "second"):  # the saved model ships the tokenizer either way
        saved = json.loads((tmp_path / run_dir / "model" / "tokenizer_config.json").read_text())
        assert saved["eos_token"] == "<|im_end|>"
    shorter = build_datasets(chat_cfg(cache_dir, "data.seq_len=48"))[0]
    assert shorter.facts["cache"] == "miss" and shorter.seq_len == 48
    facts = second["data"]
    assert facts["source"] == "chat" and facts["records"] + facts["dropped"] == 40 and facts["tokens"] > 40 * 10
    assert facts["truncated"] > 0 and facts["prepare_s"] >= 0  # seq_len 64 cuts a few of the longer records
    unchanging = ("source", "records", "tokens", "truncated", "dropped", "rows", "packed")
    assert {key: first["data"][key] for key in unchanging} == {key: facts[key] for key in unchanging}


def test_a_changed_byte_misses_and_a_touched_file_hits(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes((EXAMPLES / "chat.jsonl").read_bytes())
    cfg = chat_cfg(f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}")
    assert build_datasets(cfg)[0].facts["cache"] == "miss"
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert build_datasets(cfg)[0].facts["cache"] == "hit"
    path.write_bytes(path.read_bytes().replace(b"Paris", b"Lyon!"))  # same length, other content
    changed = build_datasets(cfg)[0]
    assert changed.facts["cache"] == "miss"


def test_the_key_follows_the_tokenizer_and_the_rows_keys_but_not_the_order(llama, tmp_path):
    base = [f"model.pretrained={llama}", "data=chat", f"data.path={EXAMPLES / 'chat.jsonl'}"]
    key = cache.entry_name(entry_key(resolve(compose_config(base))))
    same = ["data.shuffle=false", "data.eval_fraction=0.1", "data.num_proc=2", "data.seed=9"]
    other = ["data.seq_len=32", "data.pack=true", "data.roles={bot: assistant}"]
    for override in same + other:
        changed = cache.entry_name(entry_key(resolve(compose_config([*base, override]))))
        assert (changed == key) == (override in same), override
    templated = chat_tokenizer()
    templated.chat_template = templated.chat_template.replace("<|im_start|>", "<|im_start|> ")
    templated.save_pretrained(tmp_path / "other_template")
    cfg = resolve(compose_config([*base, f"data.tokenizer={tmp_path / 'other_template'}"]))
    assert cache.entry_name(entry_key(cfg)) != key


def test_cache_off_tokenizes_afresh_and_keeps_nothing(tmp_path):
    train, _ = build_datasets(chat_cfg("data.cache=false", f"data.cache_dir={tmp_path / 'cache'}"))
    assert train.facts["cache"] == "off" and not (tmp_path / "cache").exists()
    synthetic = build_datasets(compose_config(["model=bert_tiny", "data.num_samples=64", "data.seq_len=16"]))[0]
    assert synthetic.facts["cache"] == "off" and synthetic.facts["records"] == 64  # generated: nothing to keep


def test_what_a_crashed_writer_left_is_cleared_and_prepared_again(tmp_path):
    cfg = chat_cfg(f"data.cache_dir={tmp_path / 'cache'}")
    entry = tmp_path / "cache" / cache.entry_name(entry_key(cfg))
    (tmp_path / "cache" / f"{entry.name}.staging-999999").mkdir(parents=True)  # a writer killed mid-way
    entry.mkdir()  # an entry without its data.pt
    assert build_datasets(cfg)[0].facts["cache"] == "miss"
    assert (entry / "data.pt").is_file()
    assert sorted(p.name for p in entry.parent.iterdir()) == sorted(["locks", entry.name])


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_an_unreadable_entry_is_said_in_one_line_and_prepared_again(tmp_path, capsys, damage):
    """A data.pt cut short (a full disk, an interrupted copy), emptied or overwritten: one line
    on stderr, then the set is tokenized again into the same rows, and the next start hits."""
    cfg = chat_cfg(f"data.cache_dir={tmp_path / 'cache'}")
    entry = tmp_path / "cache" / cache.entry_name(entry_key(cfg))
    first = build_datasets(cfg)[0]
    stored = (entry / "data.pt").read_bytes()
    damaged = {"truncated": stored[: len(stored) // 2], "empty": b"", "garbage": bytes(range(256)) * 4}
    (entry / "data.pt").write_bytes(damaged[damage])
    capsys.readouterr()
    again = build_datasets(cfg)[0]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"relaytrain: the cached tokenized set at {entry} was unreadable (")
    assert err[0].endswith("); tokenizing again")
    assert again.facts["cache"] == "miss" and torch.equal(again.input_ids, first.input_ids)
    assert torch.equal(again.labels, first.labels)
    assert build_datasets(cfg)[0].facts["cache"] == "hit" and not capsys.readouterr().err


@pytest.mark.slow
def test_an_unreadable_entry_is_rebuilt_through_the_command(tmp_path, capsys):
    """As a user meets it: `relaytrain train` over a cut cache file says so and trains (exit 0)."""
    from relaytrain.commands.cli import main

    args = ["train", *FRESH_LLAMA, "data=chat", f"data.path={EXAMPLES / 'chat.jsonl'}", "data.seq_len=64",
            "train.steps=1", "train.untimed_steps=0", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main([*args, f"hydra.run.dir={tmp_path / 'first'}"]) == 0
    (data_pt,) = (tmp_path / "cache").glob("*/data.pt")
    data_pt.write_bytes(data_pt.read_bytes()[:1000])
    capsys.readouterr()
    assert main([*args, f"hydra.run.dir={tmp_path / 'second'}"]) == 0
    assert "was unreadable" in capsys.readouterr().err
    assert json.loads((tmp_path / "second" / "results.json").read_text())["data"]["cache"] == "miss"


def _waiting_on(locks: Path) -> int:
    """Processes blocked on a lock file under `locks` (the kernel's /proc/locks: `->` marks a waiter)."""
    inodes = {f":{path.stat().st_ino}" for path in locks.iterdir()}
    return sum(1 for line in Path("/proc/locks").read_text().splitlines()
               if "->" in line and any(field.endswith(tuple(inodes)) for field in line.split()))


def _prepare(cfg, counter: Path, out: Path, others: int) -> None:
    """One process of a run: prepares (counting the tokenizations) and says what it got. The one
    that tokenizes first waits, holding the key's lock, until the `others` are blocked on it."""
    chat = source("chat")
    original = chat.load.__func__

    def counted(cls, cfg, tokenizer_dir=None, *resolved):
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        deadline = time.monotonic() + 240  # a bound on a hang (a process that died), not on speed
        while _waiting_on(Path(cfg.data.cache_dir) / "locks") < others:
            assert time.monotonic() < deadline, "the other processes never waited on the lock"
            time.sleep(0.01)
        return original(cls, cfg, tokenizer_dir, *resolved)

    chat.load = classmethod(counted)
    train, _ = build_datasets(cfg)
    out.write_text(json.dumps({"cache": train.facts["cache"], "ids": train.input_ids.sum().item()}))


@pytest.mark.slow  # over 20 s on 2 cores: the slow step (the default suite stays within 8 minutes)
def test_several_processes_of_one_run_tokenize_once(tmp_path):
    cfg = chat_cfg(f"data.cache_dir={tmp_path / 'cache'}")
    # Spawned, as a run's workers are: a fork of this process (torch's and the tokenizer's threads
    # already running) crashed at random in the child's tokenizer.
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_prepare, args=(cfg, tmp_path / "counter", tmp_path / f"{rank}.json", 2))
               for rank in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)  # a bound on a hang, not on speed: spawned workers import torch first
        assert worker.exitcode == 0
    got = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    assert len((tmp_path / "counter").read_text().split()) == 1
    assert sorted(g["cache"] for g in got) == ["hit", "hit", "miss"] and len({g["ids"] for g in got}) == 1


def test_rendering_in_several_processes_gives_the_same_rows(llama):
    tokenizer = chat_tokenizer()
    records = read_conversations(read_records(str(EXAMPLES / "chat.jsonl"), "data.path"), "data.path")
    one = encode_records(records, tokenizer, 64, False, "data.path", num_proc=1)
    two = encode_records(records, tokenizer, 64, False, "data.path", num_proc=2)
    assert torch.equal(one.input_ids, two.input_ids) and torch.equal(one.labels, two.labels)
    assert one.facts == two.facts


def test_the_summary_shows_the_data_line():
    facts = {"source": "chat", "records": 40, "tokens": 12345, "truncated": 1, "dropped": 2, "cache": "hit",
             "prepare_s": 0.41, "mix": [{"path": "/d/a.parquet", "weight": 3.0, "records": 30, "drawn": 45},
                                        {"path": "/d/b.jsonl", "weight": 1.0, "records": 30, "drawn": 15}]}
    assert data_rows(facts) == [
        ("data", "chat: 40 records, 12.35 k tokens, 1 truncated, 2 dropped; cache hit, prepared in 0.41 s"),
        ("  mixture (drawn of held)", "a.parquet 45 of 30, b.jsonl 15 of 30")]


@pytest.mark.slow  # 100 k records rendered once: minutes on 2 cores
def test_a_100k_record_sharegpt_parquet_is_prepared_once_and_read_back_fast(llama, tmp_path):
    import datasets

    rows = [{"conversations": [{"from": "human", "value": f"What is {i} plus {i % 7}?"},
                               {"from": "gpt", "value": f"{i} plus {i % 7} is {i + i % 7}."}]}
            for i in range(100_000)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "sharegpt.parquet"))
    cfg = resolve(compose_config([f"model.pretrained={llama}", "data=chat", f"data.path={tmp_path / 'sharegpt.parquet'}",
                                  "data.seq_len=64", f"data.cache_dir={tmp_path / 'cache'}"]))
    first, second = build_datasets(cfg)[0], build_datasets(cfg)[0]
    assert (first.facts["cache"], second.facts["cache"]) == ("miss", "hit") and first.facts["records"] == 100_000
    assert torch.equal(first.input_ids, second.input_ids) and torch.equal(first.labels, second.labels)
    # how much faster the hit is, is a benchmark's figure (data_cache_prepare_ratio), not a test's


def test_the_cache_folder_follows_relaytrain_data_cache_then_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAYTRAIN_DATA_CACHE", str(tmp_path / "shared"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert unpatched_default_dir() == tmp_path / "shared"
    monkeypatch.delenv("RELAYTRAIN_DATA_CACHE")
    assert unpatched_default_dir() == tmp_path / "xdg" / "relaytrain" / "data"
