"""data.path in every form a user has it (JSON lines, JSON, parquet, arrow, csv, a glob, a
`save_to_disk` directory, a hub id), read through `datasets` for text, classification and chat
sources alike; chat in OpenAI, ShareGPT and alpaca shapes; bad input as one line naming the file
and row. Every file here is written by the test; nothing touches the network."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from relaytrain.commands.cli import main
from relaytrain.data import build_datasets, load_source
from relaytrain.data.reading import quiet_datasets
from relaytrain.models.pretrained import resolve
from relaytrain.run.compose import compose_config
from relaytrain.run.train import run
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import chat_tokenizer, tiny_decoder
from tests.data.test_data_sources import make_cfg, sentence

# `make test-gpu`'s machine has no datasets (relaytrain imports it lazily): skipped there, as are
# the modules that import this one.
datasets = pytest.importorskip("datasets")

END = "<|im_end|>"


def text_rows(n: int = 24) -> list[dict]:
    return [{"text": sentence(i), "label": i % 2} for i in range(n)]


def write_form(form: str, rows: list[dict], root) -> str:
    """`rows` stored as `form`; returns what data.path names."""
    with quiet_datasets():  # no progress bars in the output a test reads
        return _write_form(form, rows, root)


def _write_form(form: str, rows: list[dict], root) -> str:
    table = datasets.Dataset.from_list(rows)
    if form == "jsonl":
        (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(root / "rows.jsonl")
    if form == "json":  # one JSON document: a list of records
        (root / "rows.json").write_text(json.dumps(rows))
        return str(root / "rows.json")
    if form == "parquet":
        table.to_parquet(str(root / "rows.parquet"))
        return str(root / "rows.parquet")
    if form == "csv":
        table.to_csv(str(root / "rows.csv"), index=False)
        return str(root / "rows.csv")
    if form == "arrow":  # the shard save_to_disk writes
        table.save_to_disk(str(root / "saved"))
        return str(next((root / "saved").glob("*.arrow")))
    if form == "glob":
        half = len(rows) // 2
        (root / "shards").mkdir()
        datasets.Dataset.from_list(rows[:half]).to_parquet(str(root / "shards" / "part-0.parquet"))
        datasets.Dataset.from_list(rows[half:]).to_parquet(str(root / "shards" / "part-1.parquet"))
        return str(root / "shards" / "part-*.parquet")
    if form == "saved":
        table.save_to_disk(str(root / "saved"))
        return str(root / "saved")
    if form == "saved_dict":
        datasets.DatasetDict({"train": table, "test": table.select(range(4))}).save_to_disk(str(root / "dict"))
        return str(root / "dict")
    raise ValueError(form)


FORMS = ["jsonl", "json", "parquet", "csv", "arrow", "glob", "saved", "saved_dict"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_gives_the_rows_of_the_jsonl_file(tmp_path, form):
    rows = text_rows()
    (tmp_path / "ref").mkdir()
    (tmp_path / form).mkdir()
    reference = load_source(make_cfg(path=write_form("jsonl", rows, tmp_path / "ref")), None)
    got = load_source(make_cfg(path=write_form(form, rows, tmp_path / form)), None)
    assert torch.equal(got.input_ids, reference.input_ids) and torch.equal(got.labels, reference.labels)
    assert got.facts["records"] == 24 and got.facts["tokens"] == int(reference.attention_mask.sum())


def test_a_hub_id_is_loaded_with_data_name_and_data_split(tmp_path, monkeypatch):
    """A data.path that is no local path is a hub id, handed to datasets.load_dataset as it is."""
    conversations = [{"conversations": [{"from": "human", "value": f"Say {i}."}, {"from": "gpt", "value": f"{i}."}]}
                     for i in range(6)]
    asked = []
    real = datasets.load_dataset

    def load_dataset(path, name=None, **kwargs):
        if path == "someone/chat-data":
            asked.append((path, name, kwargs.get("split")))
            return datasets.Dataset.from_list(conversations)
        return real(path, name, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    checkpoint = tiny_decoder(tmp_path / "llama", layers=1)
    cfg = resolve(compose_config([f"model.pretrained={checkpoint}", "data=chat", "data.path=someone/chat-data",
                                  "data.name=en", "data.split=train_sft", "data.seq_len=32", "data.cache=false"]))
    train, _ = build_datasets(cfg)
    assert asked == [("someone/chat-data", "en", "train_sft")] and len(train) == 6
    assert chat_tokenizer().decode(train.labels[5][train.labels[5] != -100].tolist()) == "5." + END


def test_a_hub_id_offline_without_a_cached_copy_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)  # a cached copy must not hide the error
    cfg = make_cfg(path="someone/text-data")
    with pytest.raises(ConfigError, match="hub is unreachable for someone/text-data"):
        load_source(cfg, None)


# --------------------------------------------------------------------------- chat shapes


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_decoder(tmp_path_factory.mktemp("forms") / "llama", layers=2)


def chat_cfg(checkpoint, path, *overrides: str):
    return resolve(compose_config([f"model.pretrained={checkpoint}", "data=chat", f"data.path={path}",
                                   "data.seq_len=64", "strategy.microbatch_size=2", "strategy.num_microbatches=2",
                                   "train.steps=2", "train.untimed_steps=1", "data.cache=false", *overrides]))


CONVERSATIONS = [
    [("system", "Be brief."), ("user", "What is 2 + 3?"), ("assistant", "It is 5.")],
    [("user", "Name a colour."), ("assistant", "Red."), ("user", "Another?"), ("assistant", "Blue.")],
    [("user", "Look it up."), ("tool", "lookup says 42"), ("assistant", "It is 42.")],
]
SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def as_messages(turns) -> dict:
    return {"messages": [{"role": role, "content": text} for role, text in turns]}


def as_sharegpt(turns, names=SHAREGPT) -> dict:
    return {"conversations": [{"from": names[role], "value": text} for role, text in turns]}


def test_sharegpt_and_messages_give_the_same_rows_and_labels(llama, tmp_path):
    messages = write_form("jsonl", [as_messages(t) for t in CONVERSATIONS], tmp_path)
    (tmp_path / "sharegpt").mkdir()
    sharegpt = write_form("parquet", [as_sharegpt(t) for t in CONVERSATIONS], tmp_path / "sharegpt")
    a, b = (build_datasets(chat_cfg(llama, path))[0] for path in (messages, sharegpt))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    replies = chat_tokenizer().decode(b.labels[1][b.labels[1] != -100].tolist())
    assert replies == "Red." + END + "Blue." + END  # the replies only, every one of them


def test_data_roles_names_other_speakers_and_a_top_level_system_opens_the_conversation(llama, tmp_path):
    names = {"system": "system", "user": "person", "assistant": "bot", "tool": "tool"}
    rows = [{**as_sharegpt(CONVERSATIONS[0][1:], names), "system": "Be brief."}]
    path = write_form("jsonl", rows, tmp_path)
    reference = build_datasets(chat_cfg(llama, write_form("json", [as_messages(CONVERSATIONS[0])], tmp_path)))[0]
    mapped = build_datasets(chat_cfg(llama, path, "data.roles={person: user, bot: assistant}"))[0]
    assert torch.equal(mapped.input_ids, reference.input_ids) and torch.equal(mapped.labels, reference.labels)
    with pytest.raises(ConfigError, match=r"line 1: message 1 is from 'person', which names no role; map it with "
                                          r"data.roles=\{person: assistant\}"):
        build_datasets(chat_cfg(llama, path))


def test_sharegpt_and_messages_in_parquet_fine_tune_to_the_saved_models_held_out_loss(llama, tmp_path):
    """ShareGPT records in one parquet file, messages held out in another, each with the other
    shape's column present and null (as a file written from a table of both has it): a null
    column is no record of that form. The run's held-out loss, on the replies only, equals the
    saved model's loss by transformers."""
    rows = [{"messages": None, **as_sharegpt(t)} for t in CONVERSATIONS * 4]
    held = [{**as_messages(t), "conversations": None} for t in (CONVERSATIONS * 2)[:5]]
    (tmp_path / "train").mkdir()
    (tmp_path / "held").mkdir()
    train_path = write_form("parquet", rows, tmp_path / "train")
    held_path = write_form("parquet", held, tmp_path / "held")
    cfg = chat_cfg(llama, train_path, f"data.eval_path={held_path}", "train.save_model=true", "optim.lr=1e-2")
    results = run(cfg, tmp_path / "run", quiet=True)
    _, held_out = build_datasets(cfg)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model").eval()
    with torch.no_grad():
        out = model(input_ids=held_out.input_ids, attention_mask=held_out.attention_mask, labels=held_out.labels)
    items = int((held_out.labels[:, 1:] != -100).sum())
    assert results["eval"][-1]["items"] == items
    assert results["eval"][-1]["loss"] == pytest.approx(float(out.loss), rel=1e-5)
    assert math.isfinite(results["loss"][-1]) and results["data"]["records"] == 12


def test_a_held_out_split_of_a_saved_dataset_dict(llama, tmp_path):
    path = write_form("saved_dict", [as_messages(t) for t in CONVERSATIONS * 2], tmp_path)
    train, held_out = build_datasets(chat_cfg(llama, path, "data.eval_split=test"))
    assert len(train) == 6 and len(held_out) == 4


# --------------------------------------------------------------------------- bad input


def cli_error(args: list[str], capsys) -> str:
    try:
        code = main(["train", *args])
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_bad_record_in_parquet_names_the_file_and_row(llama, tmp_path):
    rows = [as_sharegpt(t) for t in CONVERSATIONS]
    rows[2]["conversations"][2]["from"] = "narrator"
    path = write_form("parquet", rows, tmp_path)
    with pytest.raises(ConfigError, match=rf"^{path} row 3: message 3 is from 'narrator', which names no role"):
        build_datasets(chat_cfg(llama, path))


def test_a_record_of_no_known_shape_and_a_missing_column_name_file_and_row(tmp_path):
    path = write_form("csv", [{"sentence": sentence(i), "label": 0} for i in range(4)], tmp_path)
    with pytest.raises(ConfigError, match=rf"{path} row 1: no 'text' text \(data.text_field=text\)"):
        load_source(make_cfg(path=path), None)
    chat = write_form("parquet", [{"prompt": "Hi", "answer": "Yo"}], tmp_path)
    with pytest.raises(ConfigError, match=rf"{chat} row 1: neither a 'messages' list"):
        build_datasets(chat_cfg(tiny_decoder(tmp_path / "llama", layers=1), chat))


def test_an_unreadable_file_a_missing_path_and_an_empty_glob_are_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=rf"data.path={broken} cannot be read as parquet"):
        load_source(make_cfg(path=str(broken)), None)
    base = ["model=llama_tiny", "data=chat", f"hydra.run.dir={tmp_path / 'run'}"]
    assert "does not exist" in cli_error([*base, f"data.path={tmp_path / 'missing.parquet'}"], capsys)
    assert "matches no file" in cli_error([*base, f"data.path={tmp_path / 'none-*.jsonl'}"], capsys)
    line = cli_error([*base, f"data.path={broken}", "data.eval_split=test"], capsys)
    assert "data.eval_split picks a split of a `datasets` directory or hub dataset" in line


@pytest.mark.parametrize("form", ["txt", "parquet"])
def test_a_text_corpus_in_a_plain_file_gives_the_saved_directorys_blocks(tmp_path, form):
    lines = [sentence(i) + " ." for i in range(60)]
    datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(tmp_path / "saved"))
    if form == "txt":
        (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
        path = str(tmp_path / "corpus.txt")
    else:
        path = write_form("parquet", [{"text": line} for line in lines], tmp_path)
    wikitext = {"source": "wikitext", "name": "wikitext-2-raw-v1"}
    reference = load_source(make_cfg("gpt2", "causal_lm", path=str(tmp_path / "saved"), **wikitext), None)
    got = load_source(make_cfg("gpt2", "causal_lm", path=path, **wikitext), None)
    assert torch.equal(got.input_ids, reference.input_ids) and got.facts["records"] == 60
    with pytest.raises(ConfigError, match=rf"data.eval_split=validation names a split, and data.path={path} is files"):
        load_source(make_cfg("gpt2", "causal_lm", path=path, eval_split="validation", **wikitext), None)
