"""`data=prompts`: prompts (text or conversations, with columns for the reward functions) as one
row each, token for token what TRL 1.16's GRPOTrainer makes of them (`_tokenize_prompts`), with
their records; prompts that leave a completion no room dropped and counted; bad records one line;
the records through the tokenize cache and data.eval_fraction; the config checks between an
objective that learns online and the sources."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relaytrain.data import build_datasets
from relaytrain.data.sources import source
from relaytrain.objectives import objective, register_objective
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.run.checks import _check_pairs
from relaytrain.run.compose import compose_config, validate
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import bos_adding_tokenizer

SEQ_LEN, COMPLETION = 64, 16  # a prompt may take SEQ_LEN - COMPLETION = 48 tokens
LONG = "Two plus two is four; three times three is nine, and the quick brown fox jumps over the lazy dog."


@register_objective
class OnlineLM(CausalLM):
    """A causal LM that learns online, as objective=grpo will: its completions sampled for data=prompts'
    prompts, G of them a prompt (`rows_per_item`), at most max_completion_length tokens each."""

    learns_online = True
    rows_per_item = 4
    max_completion_length = COMPLETION
    rollout_engine = "builtin"
    rollout_placement = "auto"
    rewards = ("exact_answer",)
    reward_weights = None


ONLINE = objective(OnlineLM.name)  # its import path: tests.data.test_prompts_data:OnlineLM


def user(text: str) -> dict:
    return {"role": "user", "content": text}


FORMS = {
    # The third prompt is longer than 48 tokens: dropped.
    "text": [{"prompt": "What is 2+2?", "answer": "4", "meta": {"level": 1, "tags": ["math"]}},
             {"prompt": "The capital of France is", "answer": "Paris", "meta": {"level": 2, "tags": []}},
             {"prompt": LONG * 2, "answer": "nine", "meta": {"level": 3, "tags": ["long"]}},
             {"prompt": "Hello", "answer": None, "meta": {"level": 1, "tags": ["greeting", "short"]}}],
    "conversations": [{"prompt": [{"role": "system", "content": "Be brief."}, user("What is 2+2?")], "answer": "4"},
                      {"prompt": [user("Hi"), {"role": "assistant", "content": "Hello!"}, user("Capital of France?")],
                       "answer": "Paris"},
                      {"prompt": [user(LONG)], "answer": "nine"},
                      {"prompt": [user("Two plus two?")], "answer": "4"}],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The ChatML test tokenizer, with a bos that tokenizing text adds (and the chat template's
    tokenizing does not), so both ways TRL tokenizes prompts are told apart."""
    return bos_adding_tokenizer(tmp_path_factory.mktemp("prompts_tokenizer"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Each form as JSON lines and as Parquet (written by pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("prompts_files")
    written = {name: write_jsonl(root / f"{name}.jsonl", records) for name, records in FORMS.items()}
    for name, records in FORMS.items():
        written[f"{name}_parquet"] = root / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(records), written[f"{name}_parquet"])
    return written


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def prompts_cfg(path: Path, tokenizer: Path, *overrides: str, task: str = OnlineLM.name):
    return compose_config(["model=llama_tiny", "model.vocab_size=320", f"model.task={task}", "data=prompts",
                           f"data.path={path}", f"data.tokenizer={tokenizer}", f"data.seq_len={SEQ_LEN}",
                           "data.cache=false", *overrides])


def load(path: Path, tokenizer: Path, *overrides: str, online=ONLINE):
    return build_datasets(prompts_cfg(path, tokenizer, *overrides), objective=online)


def trl_prompt_ids(tokenizer_dir: Path, prompts: list) -> list[list[int]]:
    """TRL's own `GRPOTrainer._tokenize_prompts` on the prompts, with a trainer's defaults (no
    tools, no chat template or kwargs of its own, not a vision model, no environments)."""
    from transformers import AutoTokenizer

    trl = pytest.importorskip("trl")  # the dev extra pins the version compared with
    trainer = SimpleNamespace(processing_class=AutoTokenizer.from_pretrained(tokenizer_dir), _is_vlm=False,
                              environment_factories=None, tools=None, chat_template=None, chat_template_kwargs={})
    ids, _, _ = trl.GRPOTrainer._tokenize_prompts(trainer, prompts)
    return [list(row) for row in ids]


# --------------------------------------------------------------------------- equal to TRL


@pytest.mark.parametrize("form", ["text", "conversations", "text_parquet", "conversations_parquet"])
def test_rows_are_trls_prompt_ids_right_padded_with_their_records(files, tokenizer_dir, form):
    from transformers import AutoTokenizer

    train, held_out = load(files[form], tokenizer_dir)
    records = FORMS[form.removesuffix("_parquet")]
    theirs = trl_prompt_ids(tokenizer_dir, [r["prompt"] for r in records])
    kept = [i for i, ids in enumerate(theirs) if len(ids) <= SEQ_LEN - COMPLETION]
    assert held_out is None and kept == [0, 1, 3] and len(train) == 3 and train.input_ids.shape == (3, SEQ_LEN)
    pad = AutoTokenizer.from_pretrained(tokenizer_dir).pad_token_id
    bos = AutoTokenizer.from_pretrained(tokenizer_dir).bos_token_id
    for row, index in enumerate(kept):
        ids = theirs[index]
        assert (ids[0] == bos) == form.startswith("text")  # text is tokenized with its special tokens, chats not
        assert train.input_ids[row].tolist() == ids + [pad] * (SEQ_LEN - len(ids))
        assert train.attention_mask[row].tolist() == [1] * len(ids) + [0] * (SEQ_LEN - len(ids))
    assert (train.labels == -100).all() and train.record.tolist() == [0, 1, 2]
    where = (lambda i: f"{files[form]} row {i + 1}") if form.endswith("parquet") else \
        (lambda i: f"{files[form]} line {i + 1}")
    assert train.records == [{"prompt": records[i]["prompt"], "where": where(i),
                              **{k: v for k, v in records[i].items() if k != "prompt"}} for i in kept]


def test_too_long_prompts_are_dropped_and_counted_and_none_left_is_one_line(files, tokenizer_dir):
    train, _ = load(files["text"], tokenizer_dir)
    assert {k: train.facts[k] for k in ("source", "records", "truncated", "dropped", "rows")} == {
        "source": "prompts", "records": 3, "truncated": 0, "dropped": 1, "rows": 3}
    assert train.facts["tokens"] == int(train.attention_mask.sum())
    # More room for the prompt (a shorter completion) keeps the long one.
    shorter = OnlineLM()
    shorter.max_completion_length = 4
    assert load(files["text"], tokenizer_dir, "data.seq_len=128", online=shorter)[0].facts["dropped"] == 0
    with pytest.raises(ConfigError) as refused:
        load(files["text"], tokenizer_dir, "data.seq_len=18")
    message = str(refused.value)
    assert message.startswith("data.path: every prompt is longer than the 2 tokens data.seq_len=18 leaves beside "
                              "objective.max_completion_length=16 (the longest has ")
    assert "so all 4 were dropped; raise data.seq_len to at least" in message and "\n" not in message


def test_held_out_prompts_and_a_second_load_from_the_cache_keep_the_records(files, tokenizer_dir, tmp_path):
    overrides = (f"data.eval_path={files['conversations']}", "data.cache=true", f"data.cache_dir={tmp_path}")
    first, first_held_out = load(files["text_parquet"], tokenizer_dir, *overrides)
    again, held_out = load(files["text_parquet"], tokenizer_dir, *overrides)
    assert (first.facts["cache"], again.facts["cache"]) == ("miss", "hit")
    for made, read in ((first, again), (first_held_out, held_out)):
        assert all(torch.equal(getattr(made, f), getattr(read, f))
                   for f in ("input_ids", "labels", "attention_mask", "record"))
        assert read.records == made.records and read.records is not made.records
    assert held_out.records[0]["prompt"] == FORMS["conversations"][0]["prompt"]
    assert held_out.records[0]["where"] == f"{files['conversations']} line 1"


def test_prompts_held_out_by_a_fraction_point_into_the_whole_sets_records(files, tokenizer_dir):
    whole, _ = load(files["text"], tokenizer_dir)
    train, held_out = load(files["text"], tokenizer_dir, "data.eval_fraction=0.34")
    assert (len(train), len(held_out)) == (2, 1) and train.records is held_out.records == whole.records
    assert sorted(train.record.tolist() + held_out.record.tolist()) == [0, 1, 2]
    for part in (train, held_out):
        for row, record in enumerate(part.record.tolist()):
            assert torch.equal(part.input_ids[row], whole.input_ids[record])


def test_a_conversation_needs_a_chat_template_and_text_does_not(files, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tokenizer_dir)
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    assert torch.equal(load(files["text"], tmp_path / "bare")[0].input_ids,
                       load(files["text"], tokenizer_dir)[0].input_ids)
    with pytest.raises(ConfigError, match="has no chat template"):
        load(files["conversations"], tmp_path / "bare")


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("records", "line", "message"), [
    ([{"question": "a"}], 1, r"no 'prompt'; a record gives its prompt as text or as a list of turns"),
    ([{"prompt": 3}], 1, r"'prompt' must be text or a non-empty list of turns"),
    ([{"prompt": ""}], 1, r"'prompt' is empty"),
    ([{"prompt": [{"role": "user"}]}], 1, r"'prompt' turn 1 is not a"),
    ([{"prompt": [{"role": "robot", "content": "a"}]}], 1, r"'prompt' turn 1 has role 'robot'"),
    ([{"prompt": [user("a"), {"role": "assistant", "content": "b"}]}], 1, r"'prompt' ends with an assistant turn"),
    ([{"prompt": "a"}, {"prompt": [user("b")]}], 2,
     r"a prompt of conversations, and .* line 1 holds one of text; one file holds records of one form"),
    ([{"prompt": "a", "where": "here"}], 1, r"a column named 'where'.*rename the column"),
    (["[1, 2]"], 1, r"expected a JSON object, got a list"),
])
def test_a_bad_record_is_one_line_naming_the_file_and_line(tokenizer_dir, tmp_path, records, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(ConfigError, match=message) as caught:
        load(path, tokenizer_dir)
    assert str(caught.value).startswith(f"{path} line {line}: ") and "\n" not in str(caught.value)


def test_a_column_of_no_plain_value_is_one_line_naming_it(tokenizer_dir, tmp_path):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "dated.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "asked": datetime.datetime(2024, 1, 2)}]), path)
    with pytest.raises(ConfigError, match=r"column 'asked' holds a datetime, .* store it as text") as caught:
        load(path, tokenizer_dir)
    assert str(caught.value).startswith(f"{path} row 1: ") and "\n" not in str(caught.value)


def check_config(path: Path, tokenizer: Path, *overrides: str, task: str = OnlineLM.name) -> None:
    validate(prompts_cfg(path, tokenizer, *overrides, task=task))


def test_the_config_checks_pair_prompts_with_an_objective_that_learns_online(files, tokenizer_dir):
    check_config(files["text"], tokenizer_dir)  # an objective that learns online on prompts: its G rows a prompt
    refusals = [
        ((), "causal_lm", r"^data=prompts gives prompts for an objective that samples its own completions \(.*\); "
                          r"objective=causal_lm learns from the rows the data gives: use "),
        (("data=chat",), OnlineLM.name, rf"^objective={OnlineLM.name} samples completions for prompts, which "
                                        r"data=prompts gives; data=chat gives whole rows: use data=prompts"),
        (("data.pack=true",), OnlineLM.name, r"^data.pack=true packs records into rows; data=prompts gives each"),
        (("data.streaming=true",), OnlineLM.name, r"^data.streaming=true streams .*; data=prompts reads its whole"),
        (("data.seq_len=16",), OnlineLM.name, r"^data.seq_len=16 leaves no room for a prompt beside its completion "
                                              r"\(objective.max_completion_length=16\); raise data.seq_len above 16"),
    ]
    for overrides, task, message in refusals:
        with pytest.raises(ConfigError, match=message) as caught:
            check_config(files["text"], tokenizer_dir, *overrides, task=task)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="data=prompts gives prompts for an objective that samples"):
        build_datasets(prompts_cfg(files["text"], tokenizer_dir, task="causal_lm"))


def test_an_objective_that_learns_online_needs_whole_sequences_and_prompts_not_pairs():
    prompts, chat, preference = source("prompts"), source("chat"), source("preference")
    assert prompts.gives_prompts and not (chat.gives_prompts or preference.gives_prompts)
    _check_pairs(ONLINE, prompts, 1)  # rows_per_item 4: G completions a prompt, made by the rollout stage
    with pytest.raises(ConfigError, match=r"^strategy.sequence_parallel=2 cuts sequences, and objective=.* sums each "
                                          r"sampled completion's log-probs over the whole sequence; drop"):
        _check_pairs(ONLINE, prompts, 2)
    with pytest.raises(ConfigError, match=r"samples completions for prompts, which data=prompts gives; "
                                          r"data=preference gives whole rows"):
        _check_pairs(ONLINE, preference, 1)
