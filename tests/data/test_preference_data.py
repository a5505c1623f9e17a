"""`data=preference`: pairs of TRL's forms (text or conversations, the prompt explicit or implicit)
as interleaved chosen/rejected rows, token for token what TRL 1.16's DPOTrainer makes of the same
files; bad records one line; pack, streaming and an objective that compares nothing refused; long
pairs cut or dropped and counted; a second load read from the tokenize cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relaytrain.data import build_datasets
from relaytrain.data.sources import source
from relaytrain.objectives import objective
from relaytrain.objectives.cross_entropy import CausalLM
from relaytrain.run.compose import compose_config
from relaytrain.utils.errors import ConfigError
from tests.checkpoints import CHATML, bos_adding_tokenizer, tiny_decoder

SEQ_LEN = 64
END = "<|im_end|>"
# ChatML that also renders the tools and a chat_template_kwargs variable, so that both reach it as TRL passes them.
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
            "{% if tone is defined and tone %}<|im_start|>system\nBe {{ tone }}.<|im_end|>\n{% endif %}" + CHATML)


class PairedCausalLM(CausalLM):
    """A causal LM that compares a pair's rows, as objective=dpo will (its `rows_per_item`)."""

    rows_per_item = 2


PAIRS = PairedCausalLM()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


LONG = "Two plus two is four; three times three is nine, and the quick brown fox jumps over the lazy dog."
FORMS = {
    # Explicit text: a prompt that ends mid-word (its tokens merge with the completion's), a
    # completion that ends with eos already, one cut at SEQ_LEN, one whose prompt fills it (dropped).
    "text": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": "What is the capi", "chosen": "tal of France? Paris.", "rejected": "tal? Rome" + END},
        {"prompt": "Hello", "chosen": " there, " + LONG * 2, "rejected": " you."},
        {"prompt": LONG * 2, "chosen": " Yes.", "rejected": " No."},
    ],
    "text_implicit": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Two plus two is four.", "rejected": "Two plus two is five."},
    ],
    "conversations": [
        {"prompt": [user("What is the capital of France?")], "chosen": [assistant("Paris.")],
         "rejected": [assistant("Rome.")], "tools": None, "chat_template_kwargs": {"tone": None}},
        {"prompt": [user("Hello"), assistant("Hi."), user("2+2?")],
         "chosen": [assistant("Four.")], "rejected": [assistant(LONG)], "tools": None,
         "chat_template_kwargs": {"tone": "kind"}},
        {"prompt": [user("Weather?")], "chosen": [assistant("Sunny.")], "rejected": [assistant("No.")],
         "tools": json.dumps([{"name": "weather"}]), "chat_template_kwargs": {"tone": None}},
    ],
    "conversations_implicit": [
        {"chosen": [user("What is 2+2?"), assistant("It is 4.")], "rejected": [user("What is 2+2?"), assistant("5")]},
        {"chosen": [user("Hi"), assistant("Hello!"), user("Bye"), assistant("Goodbye.")],
         "rejected": [user("Hi"), assistant("Hello!"), user("Bye"), assistant("No.")]},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The ChatML test tokenizer with TEMPLATE, and a bos that tokenizing text adds (and the chat
    template's tokenizing does not), so both ways TRL tokenizes are told apart."""
    return bos_adding_tokenizer(tmp_path_factory.mktemp("preference_tokenizer"), TEMPLATE)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Each form as JSON lines, and the explicit ones as Parquet too."""
    import datasets

    root = tmp_path_factory.mktemp("preference_files")
    written = {name: write_jsonl(root / f"{name}.jsonl", records) for name, records in FORMS.items()}
    for name in ("text", "conversations"):
        written[f"{name}_parquet"] = root / f"{name}.parquet"
        datasets.Dataset.from_list(FORMS[name]).to_parquet(written[f"{name}_parquet"])
    return written


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def preference_cfg(path: Path, tokenizer: Path, *overrides: str):
    return compose_config(["model=llama_tiny", "model.vocab_size=320", "data=preference", f"data.path={path}",
                           f"data.tokenizer={tokenizer}", f"data.seq_len={SEQ_LEN}", "data.cache=false", *overrides])


def load(path: Path, tokenizer: Path, *overrides: str):
    return build_datasets(preference_cfg(path, tokenizer, *overrides), objective=PAIRS)


# --------------------------------------------------------------------------- equal to TRL


@pytest.fixture(scope="module")
def trl_batches(files, tokenizer_dir, tmp_path_factory) -> dict[str, dict]:
    """What TRL's DPOTrainer makes of each file: its prepared dataset (prompt extracted, eos
    added, tokenized, pairs whose prompt fills max_length dropped) through its own collator."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trl = pytest.importorskip("trl")  # the dev extra pins the version compared with (~2 s to import)

    root = tmp_path_factory.mktemp("trl")
    model = AutoModelForCausalLM.from_pretrained(tiny_decoder(root / "llama", layers=1, tokenizer=False))
    tables = {name: datasets.load_dataset(path.suffix.lstrip(".").replace("jsonl", "json"), data_files=[str(path)],
                                          split="train") for name, path in files.items()}
    args = trl.DPOConfig(output_dir=str(root / "out"), max_length=SEQ_LEN, report_to=[], use_cpu=True)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=tables["text"], eval_dataset=tables,
                         processing_class=AutoTokenizer.from_pretrained(tokenizer_dir))
    return {name: trainer.data_collator(list(prepared)) for name, prepared in trainer.eval_dataset.items()}


@pytest.mark.parametrize("form", [*FORMS, "text_parquet", "conversations_parquet"])
def test_rows_are_trls_token_for_token(files, tokenizer_dir, trl_batches, form):
    train, _ = load(files[form], tokenizer_dir)
    trl = trl_batches[form]
    pairs = len(train)
    assert train.rows_per_item == 2 and trl["input_ids"].shape[0] == 2 * pairs  # the same pairs kept
    for pair in range(pairs):
        for side in (0, 1):  # TRL: every chosen row, then every rejected row; here they alternate
            ours, theirs = 2 * pair + side, side * pairs + pair
            length = int(trl["attention_mask"][theirs].sum())
            ids = trl["input_ids"][theirs, :length]
            assert torch.equal(train.attention_mask[ours], (torch.arange(SEQ_LEN) < length).long())
            assert torch.equal(train.input_ids[ours, :length], ids)
            completion = trl["completion_mask"][theirs, :length] == 1
            assert torch.equal(train.labels[ours, :length], torch.where(completion, ids, -100))
            assert (train.labels[ours, length:] == -100).all()


# --------------------------------------------------------------------------- rows and facts


def test_a_pair_is_its_chosen_row_then_its_rejected_row_labelled_on_the_completions(files, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    train, _ = load(files["text"], tokenizer_dir)
    prompt = tok("The sky is")["input_ids"]
    for row, completion in ((0, " blue."), (1, " green.")):
        whole = tok("The sky is" + completion + END)["input_ids"]
        assert whole[: len(prompt)] == prompt and whole[0] == tok.bos_token_id
        assert train.input_ids[row, : len(whole)].tolist() == whole
        assert train.labels[row, : len(whole)].tolist() == [-100] * len(prompt) + whole[len(prompt):]
        assert (train.input_ids[row, len(whole):] == tok.pad_token_id).all()


def test_long_pairs_are_cut_and_pairs_whose_prompt_fills_the_row_dropped_and_counted(files, tokenizer_dir):
    train, _ = load(files["text"], tokenizer_dir)
    assert len(train) == 3 and train.input_ids.shape == (6, SEQ_LEN)
    assert {k: train.facts[k] for k in ("records", "truncated", "dropped", "source")} == {
        "records": 3, "truncated": 1, "dropped": 1, "source": "preference"}
    assert train.facts["tokens"] == int(train.attention_mask.sum())
    with pytest.raises(ConfigError, match=r"data.path: every pair's prompt fills data.seq_len=4 tokens, so all 4"):
        load(files["text"], tokenizer_dir, "data.seq_len=4")


def test_held_out_pairs_and_a_second_load_from_the_cache(files, tokenizer_dir, tmp_path):
    overrides = (f"data.eval_path={files['text_implicit']}", "data.cache=true", f"data.cache_dir={tmp_path}")
    first, first_held_out = load(files["conversations"], tokenizer_dir, *overrides)
    again, held_out = load(files["conversations"], tokenizer_dir, *overrides)
    assert (first.facts["cache"], again.facts["cache"]) == ("miss", "hit")
    assert again.rows_per_item == held_out.rows_per_item == 2 and (len(again), len(held_out)) == (3, 2)
    for made, read in ((first, again), (first_held_out, held_out)):
        assert all(torch.equal(getattr(made, f), getattr(read, f)) for f in ("input_ids", "labels", "attention_mask"))


def test_text_pairs_need_no_chat_template(files, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tokenizer_dir)
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    text, _ = load(files["text"], tmp_path / "bare")
    assert torch.equal(text.input_ids, load(files["text"], tokenizer_dir)[0].input_ids)
    with pytest.raises(ConfigError, match="has no chat template"):
        load(files["conversations"], tmp_path / "bare")


def test_a_pairs_margin_rides_on_both_its_rows(tokenizer_dir, tmp_path):
    """TRL's `margin` column (a reward model's), where the file has one; 0 for a pair without."""
    path = write_jsonl(tmp_path / "margins.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c", "margin": 1.5},
                                                   {"prompt": "d", "chosen": " e", "rejected": " f"}])
    assert load(path, tokenizer_dir)[0].margin.tolist() == [1.5, 1.5, 0.0, 0.0]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c"}])
    assert load(plain, tokenizer_dir)[0].margin is None


def test_a_sharegpt_pair_is_read_as_trls_conversational_pair(tokenizer_dir, tmp_path):
    """LLaMA-Factory's ShareGPT pairs (`conversations` of from/value turns, `chosen` and `rejected`
    one turn each, a `system` text) give the rows of the same pair in TRL's conversational form."""
    sharegpt = {"system": "Be brief.", "conversations": [{"from": "human", "value": "Capital of France?"}],
                "chosen": {"from": "gpt", "value": "Paris."}, "rejected": {"from": "gpt", "value": "Rome."}}
    trl = {"prompt": [{"role": "system", "content": "Be brief."}, user("Capital of France?")],
           "chosen": [assistant("Paris.")], "rejected": [assistant("Rome.")]}
    ours = load(write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt]), tokenizer_dir)[0]
    theirs = load(write_jsonl(tmp_path / "trl.jsonl", [trl]), tokenizer_dir)[0]
    assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(ours.labels, theirs.labels)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("records", "line", "message"), [
    ([{"prompt": "a", "chosen": "b"}], 1, r"no 'rejected'"),
    ([{"prompt": "a", "chosen": 3, "rejected": "c"}], 1, r"'chosen' must be text or a non-empty list of turns"),
    ([{"prompt": "a", "chosen": [assistant("b")], "rejected": [assistant("c")]}], 1,
     r"'prompt' is text, 'chosen' is conversations, 'rejected' is conversations; give every part as text"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"chosen": "a b", "rejected": "a c"}], 2,
     r"a pair of text with an implicit prompt, and .* line 1 holds one of text with a prompt; one file holds"),
    ([{"prompt": "a", "completion": " b", "label": True}], 1,
     r"an unpaired example \(KTO's form\), and this objective compares pairs; .* or train with objective=kto"),
    ([{"chosen": [user("a"), assistant("b")], "rejected": [user("z"), assistant("c")]}], 1, r"imply no prompt"),
    ([{"prompt": [user("a")], "chosen": [{"role": "assistant"}], "rejected": [assistant("c")]}], 1,
     r"'chosen' turn 1 is not a"),
    ([{"prompt": "a", "chosen": "", "rejected": " c"}], 1, r"'chosen' is empty"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c", "margin": "big"}], 1, r"'margin' is 'big'; give a number"),
    ([{"conversations": [{"from": "robot", "value": "a"}], "chosen": {"from": "gpt", "value": "b"},
       "rejected": {"from": "gpt", "value": "c"}}], 1, r"a 'conversations' turn .* needs 'from'"),
])
def test_a_bad_record_is_one_line_naming_the_file_and_line(tokenizer_dir, tmp_path, records, line, message):
    assert_refused_at_its_line(load, tokenizer_dir, write_jsonl(tmp_path / "bad.jsonl", records), line, message)


def assert_refused_at_its_line(loader, tokenizer_dir: Path, path: Path, line: int, message: str) -> None:
    """`loader` (a pair's, an example's) refuses the file in one line naming it, the line and `message`."""
    with pytest.raises(ConfigError, match=message) as caught:
        loader(path, tokenizer_dir)
    assert str(caught.value).startswith(f"{path} line {line}: ") and "\n" not in str(caught.value)


def test_pack_streaming_and_an_objective_that_compares_nothing_are_refused(files, tokenizer_dir):
    preference = source("preference")
    preference.check(preference_cfg(files["text"], tokenizer_dir), PAIRS)
    refusals = [("data.pack=true", PAIRS, r"^data.pack=true packs records into rows; data=preference keeps"),
                ("data.streaming=true", PAIRS, r"^data.streaming=true streams .*; data=preference reads its whole set"),
                ("data.seq_len=64", objective("causal_lm"), r"^data=preference gives chosen/rejected pairs, and the "
                                                            r"objective causal_lm .* use objective=dpo")]
    for override, checked, message in refusals:
        with pytest.raises(ConfigError, match=message):
            preference.check(preference_cfg(files["text"], tokenizer_dir, override), checked)
    with pytest.raises(ConfigError, match="use objective=dpo"):
        build_datasets(preference_cfg(files["text"], tokenizer_dir), objective=objective("causal_lm"))


# --------------------------------------------------------------------------- unpaired examples (objective=kto)

GROUP = 3  # strategy.microbatch_size: the run of examples each KL completion is cycled in (TRL's per-device batch)
KTO_FORMS = {
    # As the text pairs above (merged tokens, eos given, one cut, one dropped), seven kept: runs of 3, 3 and 1.
    "unpaired_text": [
        {"prompt": "The sky is", "completion": " blue.", "label": True},
        {"prompt": "What is the capi", "completion": "tal of France? Paris.", "label": True},
        {"prompt": "Hello", "completion": " there, " + LONG * 2, "label": False},
        {"prompt": LONG * 2, "completion": " Yes.", "label": True},
        {"prompt": "Two plus two is", "completion": " five" + END, "label": False},
        {"prompt": "Colour:", "completion": " red.", "label": False},
        {"prompt": "Count:", "completion": " one two three.", "label": True},
        {"prompt": "Name a fruit:", "completion": " apple.", "label": True},
        {"prompt": "Name a stone:", "completion": " granite, then " + LONG, "label": False},
    ],
    "unpaired_conversations": [
        {"prompt": [user("What is the capital of France?")], "completion": [assistant("Paris.")], "label": True,
         "tools": None, "chat_template_kwargs": {"tone": None}},
        {"prompt": [user("Hello"), assistant("Hi."), user("2+2?")], "completion": [assistant(LONG)], "label": False,
         "tools": None, "chat_template_kwargs": {"tone": "kind"}},
        {"prompt": [user("Weather?")], "completion": [assistant("Sunny.")], "label": True,
         "tools": json.dumps([{"name": "weather"}]), "chat_template_kwargs": {"tone": None}},
        {"prompt": [user("Bye")], "completion": [assistant("Goodbye.")], "label": False, "tools": None,
         "chat_template_kwargs": {"tone": None}},
    ],
}
KTO = objective("kto")


@pytest.fixture(scope="module")
def kto_files(files, tmp_path_factory) -> dict[str, Path]:
    """The unpaired forms as JSON lines (text as Parquet too), and the pair files above, which
    KTO unpairs."""
    import datasets

    root = tmp_path_factory.mktemp("kto_files")
    written = {name: write_jsonl(root / f"{name}.jsonl", records) for name, records in KTO_FORMS.items()}
    written["unpaired_text_parquet"] = root / "unpaired_text.parquet"
    datasets.Dataset.from_list(KTO_FORMS["unpaired_text"]).to_parquet(written["unpaired_text_parquet"])
    return {**written, "text": files["text"], "conversations_implicit": files["conversations_implicit"]}


def load_kto(path: Path, tokenizer: Path, *overrides: str):
    cfg = preference_cfg(path, tokenizer, f"strategy.microbatch_size={GROUP}", "data.shuffle=false", *overrides)
    return build_datasets(cfg, objective=KTO)


@pytest.fixture(scope="module")
def trl_kto_batches(kto_files, tokenizer_dir, tmp_path_factory) -> dict[str, dict]:
    """What TRL's KTOTrainer makes of each file (pairs unpaired, prompt extracted, eos added,
    tokenized, long prompts dropped, KL completions cycled in runs of GROUP) through its collator."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trl = pytest.importorskip("trl")
    root = tmp_path_factory.mktemp("trl_kto")
    model = AutoModelForCausalLM.from_pretrained(tiny_decoder(root / "llama", layers=1, tokenizer=False))
    tables = {name: datasets.load_dataset(path.suffix.lstrip(".").replace("jsonl", "json"), data_files=[str(path)],
                                          split="train") for name, path in kto_files.items()}
    args = trl.KTOConfig(output_dir=str(root / "out"), max_length=SEQ_LEN, per_device_train_batch_size=GROUP,
                         report_to=[], use_cpu=True)
    trainer = trl.KTOTrainer(model=model, args=args, train_dataset=tables["unpaired_text"], eval_dataset=tables,
                             processing_class=AutoTokenizer.from_pretrained(tokenizer_dir))
    return {name: trainer.data_collator(list(prepared)) for name, prepared in trainer.eval_dataset.items()}


@pytest.mark.parametrize("form", ["unpaired_text", "unpaired_conversations", "unpaired_text_parquet", "text",
                                  "conversations_implicit"])
def test_kto_rows_are_trls_token_for_token(kto_files, tokenizer_dir, trl_kto_batches, form):
    """Row 2i: TRL's example i; row 2i+1: its KL sequence; both with its label."""
    train, _ = load_kto(kto_files[form], tokenizer_dir)
    trl = trl_kto_batches[form]
    assert train.rows_per_item == 2 and len(train) == trl["input_ids"].shape[0]
    assert torch.equal(train.desirable, trl["label"].long().repeat_interleave(2))
    for example in range(len(train)):
        for row, prefix in ((2 * example, ""), (2 * example + 1, "KL_")):
            length = int(trl[f"{prefix}attention_mask"][example].sum())
            ids = trl[f"{prefix}input_ids"][example, :length]
            assert torch.equal(train.attention_mask[row], (torch.arange(SEQ_LEN) < length).long())
            assert torch.equal(train.input_ids[row, :length], ids)
            completion = trl[f"{prefix}completion_mask"][example, :length] == 1
            assert torch.equal(train.labels[row, :length], torch.where(completion, ids, -100))
            assert (train.labels[row, length:] == -100).all()


def test_each_example_is_followed_by_its_prompt_with_its_neighbours_completion(kto_files, tokenizer_dir):
    train, _ = load_kto(kto_files["unpaired_text"], tokenizer_dir)
    # Kept: sky, capi, hello, two, colour, count, fruit, stone (the long prompt dropped), in runs of
    # GROUP: [sky capi hello] [two colour count] [fruit stone]; each takes the completion before it, the
    # first the last's.
    assert len(train) == 8 and train.desirable.tolist() == [d for d in (1, 1, 0, 0, 0, 1, 1, 0) for _ in "kl"]
    for example, neighbour in enumerate((2, 0, 1, 5, 3, 4, 7, 6)):
        prompt, _ = prompt_and_completion(train, 2 * example)
        kl_prompt, kl_completion = prompt_and_completion(train, 2 * example + 1)
        _, completion = prompt_and_completion(train, 2 * neighbour)
        kept = min(len(kl_completion), len(completion))  # either may be cut at SEQ_LEN
        assert kl_prompt == prompt and kept and kl_completion[:kept] == completion[:kept], example
        assert len(kl_completion) == len(completion) or SEQ_LEN in (int(train.attention_mask[2 * example + 1].sum()),
                                                                     int(train.attention_mask[2 * neighbour].sum()))
    assert {k: train.facts[k] for k in ("records", "truncated", "dropped", "desirable", "rows")} == {
        "records": 8, "truncated": 2, "dropped": 1, "desirable": 4, "rows": 16}


def prompt_and_completion(dataset, row: int) -> tuple[list[int], list[int]]:
    """A row's prompt ids and completion ids (its unlabelled and labelled tokens, padding left out)."""
    real = dataset.attention_mask[row] == 1
    ids, labelled = dataset.input_ids[row][real], dataset.labels[row][real] != -100
    return ids[~labelled].tolist(), ids[labelled].tolist()


def test_the_kl_pairs_follow_the_micro_batch_size_and_are_cached_apart(kto_files, tokenizer_dir, tmp_path):
    """A run with another micro-batch size pairs otherwise, so it has its own cache entry; so does
    DPO's reading of the same pairs."""
    cache = ("data.cache=true", f"data.cache_dir={tmp_path}")
    three, _ = load_kto(kto_files["text"], tokenizer_dir, *cache)
    two, _ = load_kto(kto_files["text"], tokenizer_dir, *cache, "strategy.microbatch_size=2")
    again, _ = load_kto(kto_files["text"], tokenizer_dir, *cache, "strategy.microbatch_size=2")
    pairs, _ = load(kto_files["text"], tokenizer_dir, *cache)
    assert [s.facts["cache"] for s in (three, two, again, pairs)] == ["miss", "miss", "hit", "miss"]
    assert torch.equal(two.input_ids, again.input_ids) and not torch.equal(two.input_ids, three.input_ids)
    assert torch.equal(two.input_ids[0::2], three.input_ids[0::2]) and pairs.desirable is None


@pytest.mark.parametrize(("records", "line", "message"), [
    ([{"completion": " b", "label": True}], 1, r"no 'prompt'; an unpaired example has 'prompt', 'completion' and"),
    ([{"prompt": "a", "completion": " b"}], 1, r"no 'label'"),
    ([{"prompt": "a", "label": False}], 1, r"no 'completion'"),
    ([{"prompt": "a", "completion": " b", "label": "yes"}], 1, r"'label' is 'yes'; it is true .* or false"),
    ([{"prompt": "a", "completion": [assistant("b")], "label": True}], 1,
     r"'prompt' is text, 'completion' is conversations; give every part as text"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "completion": " b", "label": True}], 2,
     r"an example of unpaired text, and .* line 1 holds one of text with a prompt; one file holds records of one"),
    ([{"prompt": [user("a")], "completion": [{"role": "assistant"}], "label": True}], 1,
     r"'completion' turn 1 is not a"),
])
def test_a_bad_unpaired_record_is_one_line_naming_the_file_and_line(tokenizer_dir, tmp_path, records, line, message):
    assert_refused_at_its_line(load_kto, tokenizer_dir, write_jsonl(tmp_path / "bad.jsonl", records), line, message)


def test_shuffled_single_or_drawn_out_examples_are_refused_for_kto(kto_files, tokenizer_dir):
    preference = source("preference")
    preference.check(preference_cfg(kto_files["unpaired_text"], tokenizer_dir, "data.shuffle=false"), KTO)
    for overrides, message in ((["data.shuffle=true"], r"^data.shuffle=true reorders the examples"),
                               (["data.shuffle=false", "strategy.microbatch_size=1"], r"^strategy.microbatch_size=1: "),
                               (["data.shuffle=false", "data.eval_fraction=0.2"], r"^data.eval_fraction=0.2 draws")):
        with pytest.raises(ConfigError, match=message):
            preference.check(preference_cfg(kto_files["unpaired_text"], tokenizer_dir, *overrides), KTO)
