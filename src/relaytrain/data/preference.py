"""Preference pairs (`data=preference`, read by `data/sources/preference.py`): a prompt and two
completions of it, the chosen and the rejected, tokenized exactly as TRL 1.16's DPOTrainer does
(its `_prepare_dataset` and `DataCollatorForPreference`), two rows a pair; or unpaired examples
for KTO, tokenized as TRL's KTOTrainer does, two rows an example (see "Unpaired examples" below).

Records come from data.path (data.eval_path held out; the parts of data.mix) in any form
`reading.py` reads, one pair a record, in one of TRL's forms (one a file: the first record fixes
it, and a record of another is refused in one line naming both):

- text with its prompt: `{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}`;
- conversations with their prompt: `prompt`, `chosen` and `rejected` lists of
  `{"role", "content"}` turns (the prompt's turns, then each completion's);
- an implicit prompt: only `chosen` and `rejected`, whole texts or whole conversations, whose
  shared beginning is the prompt (TRL's `extract_prompt`, quirks kept).

A conversation's `tools` (a list, or its JSON text) and `chat_template_kwargs` go to the chat
template, as TRL passes them. KTO's unpaired `prompt`/`completion`/`label` records are examples,
for an objective that reads them (`Objective.unpaired`); one that compares pairs refuses them.

Tokenizing (TRL's): a conversation's prompt is rendered with the generation prompt, and the prompt
with each completion whole; text gets the tokenizer's eos appended to each completion that lacks
it, and is tokenized with the tokenizer's special tokens. The prompt is the tokens the prompt
alone shares with both whole sequences (`common_prefix_length`: a template may render the prompt
alone differently, tokens may merge across the boundary); each completion is the rest. A pair
whose prompt alone fills data.seq_len is dropped (no completion token would survive); the others
are cut to data.seq_len from the right (TRL's `keep_start`). Both are counted in `facts`.

Rows: row 2i is pair i's prompt and chosen completion, row 2i+1 its prompt and rejected one,
right-padded to data.seq_len with the pad id; labels are the ids on completion tokens and -100 on
the prompt and padding (the model shifts them), so they are TRL's completion mask.

Unpaired examples (TRL's KTOTrainer): a record `{"prompt", "completion", "label"}` (text or
conversations; `label` true where the completion is desirable), or a pair, which becomes two
examples as TRL's `unpair_preference_dataset` makes them (per 1000 pairs: every chosen one,
desirable, then every rejected one). Each is tokenized as a pair's completion is, on its own, and
dropped or cut alike. Then, as TRL's "KL completions": in each run of `group` consecutive examples
(strategy.microbatch_size, TRL's per_device_train_batch_size), example j takes example j-1's
completion, the first the last's. Row 2i is example i's prompt and completion, row 2i+1 its prompt
and that KL completion; both carry its label (`desirable`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from relaytrain.data.chat import SHAREGPT_ROLES
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import special_ids
from relaytrain.data.labels import IGNORE_INDEX
from relaytrain.data.reading import Records, Where
from relaytrain.utils.errors import ConfigError, first_line

EXAMPLE = '{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}'
UNPAIRED_EXAMPLE = '{"prompt": "The sky is", "completion": " blue.", "label": true}'
COMPLETIONS = ("chosen", "rejected")
TEXT, CONVERSATION = "text", "conversations"
UNPAIR_BATCH = 1000  # TRL unpairs with `datasets.map(batched=True)`, whose batches hold 1000 records


@dataclass
class Record(ABC):
    """What a pair and an unpaired example share: where it was read ("PATH line N", "PATH row N",
    for errors), the form its record was in (`pair_form`'s, `example_form`'s), and its prompt,
    explicit (extracted already where it was implicit)."""

    where: Where | str
    form: str
    prompt: str | list[dict]
    noun: ClassVar[str] = "a record"

    @abstractmethod
    def completions(self) -> tuple:
        """Its completions, in the order they become rows."""

    @property
    def conversational(self) -> bool:
        return isinstance(self.completions()[0], list)

    def texts(self) -> Iterator[str]:
        """Every text in it: what a tokenizer trained here learns from."""
        for part in (self.prompt, *self.completions()):
            if isinstance(part, str):
                yield part
            else:
                for turn in part:
                    yield from (turn["role"], turn["content"])


@dataclass
class Pair(Record):
    """One preference pair; `template_args`: what the chat template is given besides the messages
    (tools, chat_template_kwargs)."""

    chosen: str | list[dict]
    rejected: str | list[dict]
    template_args: dict = field(default_factory=dict)
    margin: float | None = None  # TRL's `margin` column: how far a reward model should score chosen above rejected
    noun: ClassVar[str] = "a pair"

    def completions(self) -> tuple:
        return self.chosen, self.rejected


@dataclass
class Example(Record):
    """One unpaired example (KTO's): a completion of the prompt, and whether it is desirable."""

    completion: str | list[dict]
    desirable: bool
    template_args: dict = field(default_factory=dict)
    noun: ClassVar[str] = "an example"

    def completions(self) -> tuple:
        return (self.completion,)


@dataclass(frozen=True)
class Tokenized:
    """A pair's token ids as TRL's prepared dataset holds them."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    margin: float | None = None


# --------------------------------------------------------------------------- reading


def read_pairs(records: Records, key: str) -> list[Pair]:
    """Every row of `records` as a checked `Pair`, all of one form."""
    return read_parsed(records, key, parse_pair, "pair", EXAMPLE)


def read_parsed(records: Records, key: str, parse, noun: str, example: str) -> list:
    """Every row of `records` parsed by `parse(record, where)`, at least one, all of one form;
    `noun` and `example`: what a record holds, for the message when there is none."""
    parsed = [parse(record, where) for where, record in records.rows()]
    if not parsed:
        raise ConfigError(f"{key}={records.location} holds no records; write one {noun} a record, e.g. {example}")
    check_one_form(parsed)
    return parsed


def check_one_form(parsed: list[Record]) -> None:
    """The first record's form is the file's, as TRL decides from a dataset's first record whether
    to extract prompts, unpair pairs and append eos: a record of another is one line naming both."""
    first = parsed[0]
    other = next((item for item in parsed if item.form != first.form), None)
    if other is not None:
        raise ConfigError(f"{other.where}: {other.noun} of {other.form}, and {first.where} holds one of {first.form}; "
                          f"one file holds records of one form: convert them to one, or split the file by form and "
                          f"give the files as data.mix")


def from_sharegpt(record, where):
    """A ShareGPT-style pair (LLaMA-Factory's: `conversations` of {"from", "value"} turns, `chosen`
    and `rejected` one {"from": "gpt", "value"} turn each, an optional `system`) as TRL's
    conversational form: the turns as the prompt, each reply a one-turn conversation. Any other
    record as it is."""
    if not (isinstance(record, dict) and "conversations" in record and isinstance(record.get("chosen"), dict)):
        return record
    turns = record["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) and {"from", "value"} <= t.keys() for t in turns):
        raise ConfigError(f"{where}: 'conversations' must be a list of {{\"from\": ..., \"value\": ...}} turns")

    def turn(t: dict, name: str) -> dict:
        role = SHAREGPT_ROLES.get(t.get("from"))
        if role is None or not isinstance(t.get("value"), str):
            raise ConfigError(f"{where}: {name} turn {t!r} needs 'from' ({', '.join(SHAREGPT_ROLES)}) and a text "
                              f"'value'")
        return {"role": role, "content": t["value"]}

    system = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    prompt = system + [turn(t, "a 'conversations'") for t in turns]
    replies = {name: [turn(record[name], f"the {name!r}")] if isinstance(record.get(name), dict) else record.get(name)
               for name in COMPLETIONS}
    return {"prompt": prompt, **replies, **{k: v for k, v in record.items() if k == "margin"}}


def pair_form(record, where) -> str:
    """Which of TRL's forms the record is in, e.g. "text with a prompt", "conversations with an
    implicit prompt"."""
    _check_object(record, where)
    if _unpaired(record):
        raise ConfigError(f"{where}: a 'completion' and a 'label' make it an unpaired example (KTO's form), and this "
                          f"objective compares pairs; give prompt/chosen/rejected pairs, or train with objective=kto")
    for name in COMPLETIONS:
        if not _given(record, name):
            raise ConfigError(f"{where}: no {name!r}; a pair has 'chosen' and 'rejected' (and 'prompt', unless "
                              f"both completions begin with it), e.g. {EXAMPLE}")
    kinds = _one_kind(record, ("prompt", *COMPLETIONS), where)
    return f"{kinds['chosen']} with {'a' if 'prompt' in kinds else 'an implicit'} prompt"


def example_form(record: dict, where) -> str:
    """An unpaired example's form: "unpaired text" or "unpaired conversations"."""
    for name in ("prompt", "completion", "label"):
        if not _given(record, name):
            raise ConfigError(f"{where}: no {name!r}; an unpaired example has 'prompt', 'completion' and 'label', "
                              f"e.g. {UNPAIRED_EXAMPLE}")
    if not isinstance(record["label"], bool):
        raise ConfigError(f"{where}: 'label' is {record['label']!r}; it is true (the completion is desirable) or "
                          f"false (undesirable)")
    return f"unpaired {_one_kind(record, ('prompt', 'completion'), where)['completion']}"


def _one_kind(record: dict, names: tuple[str, ...], where) -> dict[str, str]:
    """Each given part's kind (`_kind`), all one: text or conversations."""
    kinds = {name: _kind(record[name], where, name) for name in names if _given(record, name)}
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{name!r} is {kind}" for name, kind in kinds.items())
        raise ConfigError(f"{where}: {described}; give every part as text, or every part as conversations")
    return kinds


def _check_object(record, where) -> None:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got a {type(record).__name__}; write e.g. {EXAMPLE}")


def _unpaired(record: dict) -> bool:
    """An unpaired example (KTO's form) has a completion and a label, where a pair has two completions."""
    return _given(record, "completion") or _given(record, "label")


def parse_pair(record: dict, where) -> Pair:
    """One record as a `Pair`, its prompt extracted where it is implicit."""
    record = from_sharegpt(record, where)
    form = pair_form(record, where)
    if _given(record, "prompt"):
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    else:
        prompt, chosen, rejected = extract_prompt(record["chosen"], record["rejected"])
        if not prompt:
            raise ConfigError(f"{where}: 'chosen' and 'rejected' begin differently, so they imply no prompt; give "
                              f"the prompt as 'prompt'")
    template_args = _template_args(record, where) if isinstance(chosen, list) else {}
    return Pair(where, form, prompt, chosen, rejected, template_args, _margin(record, where))


def _margin(record: dict, where) -> float | None:
    """The record's `margin` (a reward model's, TRL's column), None without one."""
    value = record.get("margin")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: 'margin' is {value!r}; give a number (how far the chosen reply's reward should "
                          f"exceed the rejected one's) or leave it out")
    return float(value)


def read_examples(records: Records, key: str) -> list[Example]:
    """Every row of `records` as checked unpaired examples, all of one form: an unpaired record is
    one, a pair two (TRL's `unpair_preference_dataset`, its order kept)."""
    parsed = read_parsed(records, key, parse_record, "example", UNPAIRED_EXAMPLE)
    if isinstance(parsed[0], Example):
        return parsed
    return [example for start in range(0, len(parsed), UNPAIR_BATCH)
            for example in unpaired_examples(parsed[start: start + UNPAIR_BATCH])]


def parse_record(record, where) -> Pair | Example:
    """One record as an unpaired `Example`, or as a `Pair` where it is one."""
    _check_object(record, where)
    if not _unpaired(record):
        return parse_pair(record, where)
    form = example_form(record, where)
    template_args = _template_args(record, where) if isinstance(record["completion"], list) else {}
    return Example(where, form, record["prompt"], record["completion"], record["label"], template_args)


def unpaired_examples(pairs: list[Pair]) -> list[Example]:
    """The pairs as examples, as TRL unpairs a batch of them: every chosen completion (desirable),
    then every rejected one."""
    chosen = [Example(p.where, p.form, p.prompt, p.chosen, True, p.template_args) for p in pairs]
    return chosen + [Example(p.where, p.form, p.prompt, p.rejected, False, p.template_args) for p in pairs]


def extract_prompt(chosen, rejected) -> tuple:
    """TRL's `extract_prompt`: the prompt is what chosen and rejected (texts, or lists of turns)
    share up to where they first differ, less a space just before it. Its quirk is kept: when one
    is all of the other's beginning, the last turn (character) they share is left to the completions."""
    shared = 0
    for shared in range(min(len(chosen), len(rejected))):  # noqa: B007 - the index after the loop is TRL's
        if chosen[shared] != rejected[shared]:
            if chosen[shared - 1] == " ":
                shared -= 1
            break
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _given(record: dict, name: str) -> bool:
    """Present and not null: columnar files give every record every column, null where it had none."""
    return record.get(name) is not None


def _kind(value, where, name: str) -> str:
    """TEXT or CONVERSATION: a part is a text, or a non-empty list of {"role", "content"} turns."""
    if isinstance(value, str):
        if not value and name != "prompt":
            raise ConfigError(f"{where}: {name!r} is empty; a completion has text")
        return TEXT
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {name!r} must be text or a non-empty list of turns "
                          f'[{{"role": ..., "content": ...}}]')
    for number, turn in enumerate(value, start=1):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise ConfigError(f"{where}: {name!r} turn {number} is not a {{\"role\": ..., \"content\": ...}} object "
                              f"with text in both")
    return CONVERSATION


def _template_args(record: dict, where) -> dict:
    """What TRL gives the chat template besides the messages: the record's tools (a list, or its
    JSON text) and its chat_template_kwargs."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: 'tools' is not JSON ({e.msg}); give a list of tool schemas") from e
    if tools is not None and not isinstance(tools, list):
        raise ConfigError(f"{where}: 'tools' must be a list of tool schemas (or its JSON text)")
    extra = record.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{where}: 'chat_template_kwargs' must be a mapping of the chat template's variables")
    return {"tools": tools, **extra}


# --------------------------------------------------------------------------- tokenizing


def tokenize_pair(tokenizer, pair: Pair) -> Tokenized:
    """The pair's prompt, chosen and rejected ids, as TRL's DPOTrainer tokenizes them."""
    prompt, whole = prompt_and_whole(tokenizer, pair, (pair.chosen, pair.rejected))
    shared = min(common_prefix_length(prompt, ids) for ids in whole)
    return Tokenized(prompt[:shared], whole[0][shared:], whole[1][shared:], pair.margin)


def tokenize_example(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """The example's prompt and completion ids, as TRL's KTOTrainer tokenizes them (as a pair's
    are, one completion alone)."""
    prompt, (whole,) = prompt_and_whole(tokenizer, example, (example.completion,))
    shared = common_prefix_length(prompt, whole)
    return prompt[:shared], whole[shared:]


def prompt_and_whole(tokenizer, item: Record, completions: tuple) -> tuple[list[int], list[list[int]]]:
    """The prompt's ids alone, and the prompt's with each completion whole: a conversation rendered
    by the chat template (the prompt with the generation prompt), text with the tokenizer's eos
    appended to each completion that lacks it."""
    if item.conversational:
        prompt = _chat_ids(tokenizer, item, item.prompt, generation_prompt=True)
        return prompt, [_chat_ids(tokenizer, item, item.prompt + completion) for completion in completions]
    eos = tokenizer.eos_token
    ended = [text if text.endswith(eos) else text + eos for text in completions]
    # TRL calls the tokenizer with its defaults: special tokens (a bos) added.
    return tokenizer(text=item.prompt)["input_ids"], [tokenizer(text=item.prompt + text)["input_ids"] for text in ended]


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens the two share."""
    for length, (a, b) in enumerate(zip(ids, other, strict=False)):
        if a != b:
            return length
    return min(len(ids), len(other))


def _chat_ids(tokenizer, item: Record, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    from jinja2.exceptions import TemplateError

    try:
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt, **item.template_args)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{item.where}: the chat template refuses this {item.noun.split()[-1]} ({first_line(e)}); "
                          f"fix the record or use data.tokenizer=DIR with a template that takes it") from e
    return list(encoded["input_ids"])


def check_eos(tokenizer, pairs: list[Record]) -> None:
    """Text completions end with the tokenizer's eos, which it must have."""
    if tokenizer.eos_token is None and any(not pair.conversational for pair in pairs):
        raise ConfigError(f"the tokenizer {tokenizer.name_or_path or '(unnamed)'} has no eos token, which text "
                          f"completions end with; use data.tokenizer=DIR with one that has")


# --------------------------------------------------------------------------- rows


def encode_pairs(pairs: list[Pair], tokenizer, seq_len: int, key: str) -> TokenDataset:
    """The pairs as interleaved rows of seq_len (chosen, then rejected), pairs whose prompt fills
    seq_len dropped, long ones cut; both counted in the facts."""
    check_eos(tokenizer, pairs)
    kept, dropped = fitting([tokenize_pair(tokenizer, pair) for pair in pairs], seq_len, key, "pair")
    dataset = pair_rows(kept, seq_len, special_ids(tokenizer).pad)
    truncated = sum(len(t.prompt) + max(len(t.chosen), len(t.rejected)) > seq_len for t in kept)
    dataset.facts = {"records": len(kept), "tokens": int(dataset.attention_mask.sum()), "truncated": truncated,
                     "dropped": dropped, "rows": 2 * len(kept)}
    return dataset


def fitting(tokenized: list, seq_len: int, key: str, noun: str) -> tuple[list, int]:
    """The tokenized records whose prompt leaves a completion token room in seq_len (TRL drops the
    others), and how many were dropped; none left is one line."""
    kept = [t for t in tokenized if len(t.prompt) < seq_len]
    dropped = len(tokenized) - len(kept)
    if not kept:
        raise ConfigError(f"{key}: every {noun}'s prompt fills data.seq_len={seq_len} tokens, so all {dropped} were "
                          f"dropped; raise data.seq_len")
    return kept, dropped


def pair_rows(pairs: list[Tokenized], seq_len: int, pad: int) -> TokenDataset:
    """Row 2i: pair i's prompt and chosen ids, row 2i+1: its prompt and rejected ids, each cut to
    seq_len and right-padded; labels on the completions only."""
    rows = 2 * len(pairs)
    ids = torch.full((rows, seq_len), pad, dtype=torch.long)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((rows, seq_len), dtype=torch.long)
    for row, (prompt, completion) in enumerate((t.prompt, c) for t in pairs for c in (t.chosen, t.rejected)):
        tokens = torch.tensor((prompt + completion)[:seq_len], dtype=torch.long)
        ids[row, : len(tokens)] = tokens
        attention[row, : len(tokens)] = 1
        labels[row, len(prompt): len(tokens)] = tokens[len(prompt):]
    given = [t.margin for t in pairs if t.margin is not None]
    margin = torch.tensor([t.margin or 0.0 for t in pairs for _ in range(2)]) if given else None  # on both rows
    return TokenDataset(input_ids=ids, labels=labels, attention_mask=attention, margin=margin, rows_per_item=2)


@dataclass(frozen=True)
class TokenizedExample:
    """An unpaired example's ids as TRL's prepared dataset holds them, and its label."""

    prompt: list[int]
    completion: list[int]
    desirable: bool


def encode_examples(examples: list[Example], tokenizer, seq_len: int, key: str, group: int) -> TokenDataset:
    """The examples as rows of seq_len, each followed by its KL row (the completion of the example
    before it in its run of `group`), labelled `desirable`; examples whose prompt fills seq_len
    dropped, long ones cut, both counted in the facts."""
    check_eos(tokenizer, examples)
    tokenized = [TokenizedExample(*tokenize_example(tokenizer, e), e.desirable) for e in examples]
    kept, dropped = fitting(tokenized, seq_len, key, "example")
    kl = kl_completions([t.completion for t in kept], group)
    dataset = pair_rows([Tokenized(t.prompt, t.completion, other) for t, other in zip(kept, kl, strict=True)],
                        seq_len, special_ids(tokenizer).pad)
    desirable = torch.tensor([t.desirable for t in kept], dtype=torch.long).repeat_interleave(2)
    dataset = dataclasses.replace(dataset, desirable=desirable)
    dataset.facts = {"records": len(kept), "tokens": int(dataset.attention_mask.sum()),
                     "truncated": sum(len(t.prompt) + len(t.completion) > seq_len for t in kept), "dropped": dropped,
                     "rows": 2 * len(kept), "desirable": int(desirable[0::2].sum())}
    return dataset


def kl_completions(completions: list[list[int]], group: int) -> list[list[int]]:
    """TRL's KL completions: in each run of `group` consecutive examples, each takes the completion
    of the one before it, the first the last's ((x1, y1) ... (xn, yn) -> (x1, yn), (x2, y1) ...)."""
    shifted = []
    for start in range(0, len(completions), group):
        run = completions[start: start + group]
        shifted += run[-1:] + run[:-1]
    return shifted
