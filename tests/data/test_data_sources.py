"""File and hub data sources: JSONL parsing and its errors, tokenizers, labels per task, and
GLUE / WikiText through local `datasets` directories (nothing here touches the network)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from relaytrain.data import build_dataset, load_source
from relaytrain.data.labels import IGNORE_INDEX
from relaytrain.data.synthetic import CLS_ID, MASK_ID
from relaytrain.data.tokenizer import find_tokenizer, load_tokenizer
from relaytrain.models.family import family_spec
from relaytrain.schema.config import ModelConfig, RelayTrainConfig
from relaytrain.utils.errors import ConfigError

# `make test-gpu`'s machine has no datasets (relaytrain imports it lazily): skipped there, as are
# the modules that import this one.
datasets = pytest.importorskip("datasets")

PAD_ID, SEP_ID = 0, 2
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired cats sleep under warm red blankets".split()
)


def sentence(i: int) -> str:
    """Deterministic sentences of 3..14 words, so padding varies across samples."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 12))


def make_cfg(family: str = "bert", task: str = "classification", vocab_size: int = 512, **data):
    cfg = OmegaConf.structured(RelayTrainConfig)
    cfg.model = ModelConfig(
        name=f"{family}_tiny",
        family=family,
        num_layers=2,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        vocab_size=vocab_size,
        task=task,
        num_labels=2,
    )
    cfg.data.source = "jsonl"
    cfg.data.seq_len = 16
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def text_records(n: int = 40) -> list[dict]:
    return [{"text": sentence(i), "label": i % 2} for i in range(n)]


# --------------------------------------------------------------------------- jsonl


def test_jsonl_text_classification_trains_and_saves_a_tokenizer(tmp_path):
    cfg = make_cfg(path=write_jsonl(tmp_path / "train.jsonl", text_records()))
    ds = build_dataset(cfg, tokenizer_dir=str(tmp_path / "run"))

    assert ds.input_ids.shape == (40, 16) and ds.input_ids.dtype == torch.long
    assert ds.labels.tolist() == [i % 2 for i in range(40)] and ds.labels.dtype == torch.long
    assert (ds.input_ids[:, 0] == CLS_ID).all()
    # Short sentences are padded: the mask marks exactly the non-pad positions.
    assert ds.attention_mask is not None and ds.attention_mask.shape == (40, 16)
    assert (ds.attention_mask == 0).any() and (ds.attention_mask == 1).any()
    assert ((ds.input_ids == PAD_ID) == (ds.attention_mask == 0)).all()
    # Each row ends its real tokens with [SEP], even when truncated.
    last_real = ds.attention_mask.sum(dim=1) - 1
    assert (ds.input_ids[torch.arange(40), last_real] == SEP_ID).all()
    assert int(ds.input_ids.max()) < cfg.model.vocab_size
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()


def test_jsonl_text_pairs_are_joined_with_separators(tmp_path):
    records = [{"premise": sentence(i), "hypothesis": sentence(i + 1), "y": i % 2} for i in range(10)]
    cfg = make_cfg(
        path=write_jsonl(tmp_path / "pairs.jsonl", records),
        text_field="premise,hypothesis",
        label_field="y",
        seq_len=48,
    )
    ds = load_source(cfg, None)
    assert ds.input_ids.shape == (10, 48)
    assert ((ds.input_ids == SEP_ID).sum(dim=1) == 2).all()
    assert ds.labels.tolist() == [i % 2 for i in range(10)]


def test_jsonl_pre_tokenized_input_ids_are_truncated_and_padded_with_zero(tmp_path):
    records = [
        {"input_ids": [1, 10, 11, 12, 13, 14, 2], "label": 1},
        {"input_ids": [1, 20, 2], "label": 0},
    ]
    cfg = make_cfg(path=write_jsonl(tmp_path / "ids.jsonl", records), seq_len=5)
    ds = load_source(cfg, str(tmp_path / "run"))

    assert ds.input_ids.tolist() == [[1, 10, 11, 12, 13], [1, 20, 2, 0, 0]]
    assert ds.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert ds.labels.tolist() == [1, 0]
    assert not (tmp_path / "run" / "tokenizer").exists()  # no text, so nothing was trained


def test_attention_mask_is_none_when_no_sample_is_padded(tmp_path):
    records = [{"input_ids": [5 + i, 6, 7, 8], "label": i % 2} for i in range(4)]
    cfg = make_cfg(path=write_jsonl(tmp_path / "ids.jsonl", records), seq_len=4)
    ds = load_source(cfg, None)
    assert ds.attention_mask is None
    assert ds.input_ids.shape == (4, 4)


def test_gpt2_causal_lm_labels_ignore_padding(tmp_path):
    records = [{"text": sentence(i)} for i in range(30)]
    cfg = make_cfg("gpt2", "causal_lm", path=write_jsonl(tmp_path / "lm.jsonl", records), seq_len=24)
    ds = load_source(cfg, str(tmp_path / "run"))

    mask = ds.attention_mask
    assert mask is not None and (mask == 0).any()
    assert ds.labels.shape == ds.input_ids.shape
    assert (ds.labels[mask == 1] == ds.input_ids[mask == 1]).all()
    assert (ds.labels[mask == 0] == IGNORE_INDEX).all()
    assert int(ds.input_ids.max()) < cfg.model.vocab_size


def test_masked_lm_masking_is_deterministic_for_a_seed(tmp_path):
    path = write_jsonl(tmp_path / "mlm.jsonl", [{"text": sentence(i)} for i in range(60)])
    first = load_source(make_cfg(task="masked_lm", path=path, seed=7), None)
    again = load_source(make_cfg(task="masked_lm", path=path, seed=7), None)
    other = load_source(make_cfg(task="masked_lm", path=path, seed=8), None)

    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    assert not torch.equal(first.labels, other.labels)

    chosen = first.labels != IGNORE_INDEX
    assert chosen.any(dim=1).all()  # every sample predicts at least one token
    assert (first.input_ids[chosen] == MASK_ID).all()
    assert (first.labels[chosen] > 4).all()  # never padding or a special token
    assert (first.input_ids[~chosen] != MASK_ID).all()
    original = torch.where(chosen, first.labels, first.input_ids)
    real = original > 4  # ids 0..4 are [PAD], [CLS], [SEP], [MASK], [UNK]
    assert 0.05 < chosen.sum() / real.sum() < 0.35  # about MLM_MASK_RATE of the real tokens


BAD_LINES = [
    pytest.param(['{"text": "a b", "label": 0}', '{"text": "oops'], 2, "malformed JSON", id="malformed-json"),
    pytest.param(["[1, 2, 3]"], 1, "expected a JSON object", id="not-an-object"),
    pytest.param(['{"text": "a", "label": 0}', '{"label": 1}'], 2, "no 'text' text", id="no-text-or-ids"),
    pytest.param(['{"text": "a b"}'], 1, "no 'label' label", id="missing-label"),
    pytest.param(['{"text": "a", "label": "positive"}'], 1, "not an integer", id="label-not-int"),
    pytest.param(['{"text": "a", "label": 2}'], 1, "outside [0, 2)", id="label-out-of-range"),
    pytest.param(['{"input_ids": [1, 999], "label": 0}'], 1, "token id 999", id="token-id-out-of-vocab"),
    pytest.param(['{"input_ids": [1, -3], "label": 0}'], 1, "token id -3", id="negative-token-id"),
    pytest.param(["", "   ", '{"text": "", "label": 0}'], 3, "non-empty text", id="blank-lines-still-count"),
]


@pytest.mark.parametrize("lines, line_number, problem", BAD_LINES)
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, lines, line_number, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ConfigError) as caught:
        load_source(make_cfg(path=path), None)
    message = str(caught.value)
    assert path in message and f"line {line_number}:" in message and problem in message
    assert "\n" not in message and ";" in message  # one line, with the fix after the problem


def test_empty_jsonl_file_is_a_config_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(ConfigError, match="holds no samples"):
        load_source(make_cfg(path=str(path)), None)


def test_label_is_not_needed_for_language_modelling(tmp_path):
    path = write_jsonl(tmp_path / "lm.jsonl", [{"text": sentence(i)} for i in range(5)])
    ds = load_source(make_cfg(task="masked_lm", path=path), None)
    assert ds.labels.shape == ds.input_ids.shape


# --------------------------------------------------------------------------- tokenizers


def test_trained_tokenizer_reloads_with_auto_tokenizer(tmp_path):
    cfg = make_cfg(path=write_jsonl(tmp_path / "train.jsonl", text_records()))
    trained = load_tokenizer(cfg, [sentence(i) for i in range(40)], str(tmp_path / "run"),
                             family_spec(cfg.model.family))
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "run" / "tokenizer")

    text = sentence(3)
    assert reloaded(text)["input_ids"] == trained(text)["input_ids"]
    assert [reloaded.convert_tokens_to_ids(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert len(reloaded) <= cfg.model.vocab_size


def test_gpt2_tokenizer_is_byte_level_and_reloads(tmp_path):
    cfg = make_cfg("gpt2", "causal_lm")
    trained = load_tokenizer(cfg, [sentence(i) for i in range(40)], str(tmp_path / "run"),
                             family_spec(cfg.model.family))
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "run" / "tokenizer")
    unseen = "Zebra ünïcode ☃"  # byte-level: nothing is unknown
    assert reloaded.decode(reloaded(unseen)["input_ids"]) == unseen
    assert reloaded(unseen)["input_ids"] == trained(unseen)["input_ids"]


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_tokenizer_training_is_reproducible(family):
    """The same corpus must give the same ids, or runs of one config would not be comparable."""
    corpus = [sentence(i) + " Ünïcode, done!" for i in range(80)]
    vocabs = [load_tokenizer(make_cfg(family), corpus, None, family_spec(family)).get_vocab() for _ in range(5)]
    assert all(vocab == vocabs[0] for vocab in vocabs)


def test_saved_tokenizer_is_used_through_data_tokenizer(tmp_path):
    corpus = [sentence(i) for i in range(40)]
    load_tokenizer(make_cfg(), corpus, str(tmp_path / "first"), family_spec("bert"))
    cfg = make_cfg(tokenizer=str(tmp_path / "first" / "tokenizer"))
    found = find_tokenizer(cfg)
    assert found is not None and found(corpus[0])["input_ids"][0] == CLS_ID


def test_pretrained_dir_without_tokenizer_files_falls_through(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    load_tokenizer(make_cfg(), [sentence(i) for i in range(40)], str(tmp_path / "saved"), family_spec("bert"))

    cfg = make_cfg()
    cfg.model.pretrained = str(tmp_path / "model")
    assert find_tokenizer(cfg) is None  # no tokenizer there and none configured: one gets trained
    cfg.data.tokenizer = str(tmp_path / "saved" / "tokenizer")
    assert find_tokenizer(cfg) is not None
    # A pretrained dir that does ship a tokenizer wins over data.tokenizer.
    cfg.model.pretrained = str(tmp_path / "saved" / "tokenizer")
    cfg.data.tokenizer = str(tmp_path / "missing")
    assert find_tokenizer(cfg) is not None


def test_tokenizer_larger_than_the_model_vocab_is_a_config_error(tmp_path):
    cfg = make_cfg("gpt2", "causal_lm", vocab_size=100)  # byte-level BPE alone needs 257 ids
    with pytest.raises(ConfigError, match=r"has 257 tokens but model\.vocab_size=100"):
        load_tokenizer(cfg, [sentence(i) for i in range(10)], None, family_spec("gpt2"))


# --------------------------------------------------------------------------- glue / wikitext (local)


def save_glue_pairs(path) -> str:
    def split(n: int, offset: int, labelled: bool = True):
        return datasets.Dataset.from_dict(
            {
                "sentence1": [sentence(i + offset) for i in range(n)],
                "sentence2": [sentence(i + offset + 5) for i in range(n)],
                "label": [(i % 2 if labelled else -1) for i in range(n)],
                "idx": list(range(n)),
            }
        )

    datasets.DatasetDict(
        {"train": split(24, 0), "validation": split(8, 100), "test": split(4, 200, False)}
    ).save_to_disk(str(path))
    return str(path)


def test_glue_pairs_from_a_local_datasets_directory(tmp_path):
    path = save_glue_pairs(tmp_path / "mrpc")
    cfg = make_cfg(
        source="glue",
        name="mrpc",
        path=path,
        split="validation",
        text_field="sentence1,sentence2",
        seq_len=40,
    )
    ds = build_dataset(cfg, str(tmp_path / "run"))
    assert ds.input_ids.shape == (8, 40)
    assert ds.labels.tolist() == [i % 2 for i in range(8)]
    assert ((ds.input_ids == SEP_ID).sum(dim=1) == 2).all()


@pytest.mark.parametrize(
    "split, text_field, problem",
    [
        ("test", "sentence1,sentence2", "unlabelled"),
        ("dev", "sentence1,sentence2", "set data.split to one of train, validation, test"),
        ("train", "sentence", "no column 'sentence'"),
    ],
)
def test_glue_local_errors_name_the_fix(tmp_path, split, text_field, problem):
    path = save_glue_pairs(tmp_path / "mrpc")
    cfg = make_cfg(source="glue", name="mrpc", path=path, split=split, text_field=text_field)
    with pytest.raises(ConfigError, match=problem):
        load_source(cfg, None)


def test_local_path_that_is_not_a_datasets_directory(tmp_path):
    cfg = make_cfg(source="glue", name="sst2", path=str(tmp_path), text_field="sentence")
    with pytest.raises(ConfigError, match="is not a `datasets` directory"):
        load_source(cfg, None)


def save_wikitext(path) -> str:
    lines = []
    for i in range(60):
        lines += ["", f" = Section {i} = \n", sentence(i) + " .\n"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": lines})}).save_to_disk(str(path))
    return str(path)


def test_wikitext_causal_lm_is_chunked_into_full_blocks(tmp_path):
    cfg = make_cfg(
        "gpt2", "causal_lm", source="wikitext", name="wikitext-2-raw-v1", path=save_wikitext(tmp_path / "wt")
    )
    ds = load_source(cfg, None)
    assert ds.attention_mask is None  # concatenated text: nothing is padded
    assert ds.input_ids.shape[1] == 16 and len(ds) > 10
    assert torch.equal(ds.labels, ds.input_ids)


def test_wikitext_masked_lm_blocks_are_wrapped_in_cls_and_sep(tmp_path):
    cfg = make_cfg(
        task="masked_lm", source="wikitext", name="wikitext-2-raw-v1", path=save_wikitext(tmp_path / "wt")
    )
    ds = load_source(cfg, None)
    assert (ds.input_ids[:, 0] == CLS_ID).all() and (ds.input_ids[:, -1] == SEP_ID).all()
    chosen = ds.labels != IGNORE_INDEX
    assert chosen.any(dim=1).all()
    assert not chosen[:, 0].any() and not chosen[:, -1].any()


def test_wikitext_classification_suggests_a_language_model_task(tmp_path):
    cfg = make_cfg(source="wikitext", name="wikitext-2-raw-v1", path=save_wikitext(tmp_path / "wt"))
    with pytest.raises(ConfigError, match="model.task=masked_lm.*GPT-2"):
        load_source(cfg, None)


# --------------------------------------------------------------------------- hub (offline)


@pytest.mark.parametrize("source, name", [("glue", "sst2"), ("wikitext", "wikitext-2-raw-v1")])
def test_offline_hub_load_is_a_quick_config_error(monkeypatch, tmp_path, source, name):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(
        datasets.config, "HF_DATASETS_CACHE", tmp_path
    )  # a cached copy must not hide the error
    cfg = make_cfg(
        "gpt2" if source == "wikitext" else "bert", "causal_lm" if source == "wikitext" else "classification"
    )
    cfg.data.source, cfg.data.name, cfg.data.text_field = source, name, "text"
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_source(cfg, None)
    assert time.monotonic() - start < 60  # hub retries with back-off would take minutes
    message = str(caught.value)
    assert (
        "hub is unreachable" in message
        and "data.path=<local datasets dir>" in message
        and "data=jsonl" in message
    )


def test_offline_mode_with_an_empty_cache_is_a_config_error(monkeypatch, tmp_path):
    """When datasets itself is in offline mode it may serve its cache; a miss is still a ConfigError."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    cfg = make_cfg(source="glue", name="sst2", text_field="sentence")
    with pytest.raises(ConfigError, match="hub is unreachable"):
        load_source(cfg, None)


def test_connection_failure_is_a_config_error(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'glue' on the Hub (LocalEntryNotFoundError)")

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    cfg = make_cfg(source="glue", name="sst2", text_field="sentence")
    with pytest.raises(ConfigError, match="hub is unreachable for glue/sst2 .*LocalEntryNotFoundError"):
        load_source(cfg, None)
