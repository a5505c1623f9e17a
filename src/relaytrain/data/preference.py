"""Preference pairs (`data=preference`, read by `data/sources/preference.py`): a prompt and two
completions of it, the chosen and the rejected, tokenized exactly as TRL 1.16's DPOTrainer does
(its `_prepare_dataset` and `DataCollatorForPreference`), two rows a pair.

Records come from data.path (data.eval_path held out; the parts of data.mix) in any form
`reading.py` reads, one pair a record, in one of TRL's forms (one a file: the first record fixes
it, and a record of another is refused in one line naming both):

- text with its prompt: `{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}`;
- conversations with their prompt: `prompt`, `chosen` and `rejected` lists of
  `{"role", "content"}` turns (the prompt's turns, then each completion's);
- an implicit prompt: only `chosen` and `rejected`, whole texts or whole conversations, whose
  shared beginning is the prompt (TRL's `extract_prompt`, quirks kept).

A conversation's `tools` (a list, or its JSON text) and `chat_template_kwargs` go to the chat
template, as TRL passes them. KTO's unpaired `prompt`/`completion`/`label` records are refused.

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
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import special_ids
from relaytrain.data.labels import IGNORE_INDEX
from relaytrain.data.reading import Records, Where
from relaytrain.utils.errors import ConfigError, first_line

EXAMPLE = '{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}'
COMPLETIONS = ("chosen", "rejected")
TEXT, CONVERSATION = "text", "conversations"


@dataclass
class Pair:
    """One preference pair, its prompt explicit (extracted already where it was implicit), and
    the form its record was in; `where` ("PATH line N", "PATH row N") for errors; `template_args`: what the chat template is
    given besides the messages (tools, chat_template_kwargs)."""

    where: Where | str
    form: str  # `pair_form`'s
    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]
    template_args: dict = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)

    def texts(self) -> Iterator[str]:
        """Every text in it: what a tokenizer trained here learns from."""
        for part in (self.prompt, self.chosen, self.rejected):
            if isinstance(part, str):
                yield part
            else:
                for turn in part:
                    yield from (turn["role"], turn["content"])


@dataclass(frozen=True)
class Tokenized:
    """A pair's token ids as TRL's prepared dataset holds them."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


# --------------------------------------------------------------------------- reading


def read_pairs(records: Records, key: str) -> list[Pair]:
    """Every row of `records` as a checked `Pair`, all of one form."""
    pairs = [parse_pair(record, where) for where, record in records.rows()]
    if not pairs:
        raise ConfigError(f"{key}={records.location} holds no records; write one pair a record, e.g. {EXAMPLE}")
    check_one_form(pairs)
    return pairs


def check_one_form(pairs: list[Pair]) -> None:
    """The first pair's form is the file's, as TRL decides from a dataset's first record whether
    to extract prompts and append eos: a pair of another is one line naming both."""
    first = pairs[0]
    other = next((pair for pair in pairs if pair.form != first.form), None)
    if other is not None:
        raise ConfigError(f"{other.where}: a pair of {other.form}, and {first.where} holds one of {first.form}; one "
                          f"file holds pairs of one form: convert them to one, or split the file by form and give "
                          f"the files as data.mix")


def pair_form(record, where) -> str:
    """Which of TRL's forms the record is in, e.g. "text with a prompt", "conversations with an
    implicit prompt"."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got a {type(record).__name__}; write e.g. {EXAMPLE}")
    if _given(record, "label"):
        raise ConfigError(f"{where}: a 'label' makes it KTO's unpaired prompt/completion/label form, which "
                          f"data=preference does not read yet; give prompt/chosen/rejected pairs")
    for name in COMPLETIONS:
        if not _given(record, name):
            raise ConfigError(f"{where}: no {name!r}; a pair has 'chosen' and 'rejected' (and 'prompt', unless "
                              f"both completions begin with it), e.g. {EXAMPLE}")
    kinds = {name: _kind(record[name], where, name) for name in ("prompt", *COMPLETIONS) if _given(record, name)}
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{name!r} is {kind}" for name, kind in kinds.items())
        raise ConfigError(f"{where}: {described}; give every part as text, or every part as conversations")
    return f"{kinds['chosen']} with {'a' if 'prompt' in kinds else 'an implicit'} prompt"


def parse_pair(record: dict, where) -> Pair:
    """One record as a `Pair`, its prompt extracted where it is implicit."""
    form = pair_form(record, where)
    if _given(record, "prompt"):
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    else:
        prompt, chosen, rejected = extract_prompt(record["chosen"], record["rejected"])
        if not prompt:
            raise ConfigError(f"{where}: 'chosen' and 'rejected' begin differently, so they imply no prompt; give "
                              f"the prompt as 'prompt'")
    template_args = _template_args(record, where) if isinstance(chosen, list) else {}
    return Pair(where, form, prompt, chosen, rejected, template_args)


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
    if pair.conversational:
        prompt = _chat_ids(tokenizer, pair, pair.prompt, generation_prompt=True)
        whole = [_chat_ids(tokenizer, pair, pair.prompt + completion) for completion in (pair.chosen, pair.rejected)]
    else:
        eos = tokenizer.eos_token
        ended = [text if text.endswith(eos) else text + eos for text in (pair.chosen, pair.rejected)]
        # TRL calls the tokenizer with its defaults: special tokens (a bos) added.
        prompt = tokenizer(text=pair.prompt)["input_ids"]
        whole = [tokenizer(text=pair.prompt + text)["input_ids"] for text in ended]
    shared = min(common_prefix_length(prompt, ids) for ids in whole)
    return Tokenized(prompt[:shared], whole[0][shared:], whole[1][shared:])


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens the two share."""
    for length, (a, b) in enumerate(zip(ids, other, strict=False)):
        if a != b:
            return length
    return min(len(ids), len(other))


def _chat_ids(tokenizer, pair: Pair, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    from jinja2.exceptions import TemplateError

    try:
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt, **pair.template_args)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{pair.where}: the chat template refuses this pair ({first_line(e)}); fix the record or "
                          f"use data.tokenizer=DIR with a template that takes it") from e
    return list(encoded["input_ids"])


def check_eos(tokenizer, pairs: list[Pair]) -> None:
    """Text completions end with the tokenizer's eos, which it must have."""
    if tokenizer.eos_token is None and any(not pair.conversational for pair in pairs):
        raise ConfigError(f"the tokenizer {tokenizer.name_or_path or '(unnamed)'} has no eos token, which text "
                          f"completions end with; use data.tokenizer=DIR with one that has")


# --------------------------------------------------------------------------- rows


def encode_pairs(pairs: list[Pair], tokenizer, seq_len: int, key: str) -> TokenDataset:
    """The pairs as interleaved rows of seq_len (chosen, then rejected), pairs whose prompt fills
    seq_len dropped, long ones cut; both counted in the facts."""
    check_eos(tokenizer, pairs)
    tokenized = [tokenize_pair(tokenizer, pair) for pair in pairs]
    kept = [t for t in tokenized if len(t.prompt) < seq_len]
    dropped = len(tokenized) - len(kept)
    if not kept:
        raise ConfigError(f"{key}: every pair's prompt fills data.seq_len={seq_len} tokens, so all {dropped} were "
                          f"dropped; raise data.seq_len")
    dataset = pair_rows(kept, seq_len, special_ids(tokenizer).pad)
    truncated = sum(len(t.prompt) + max(len(t.chosen), len(t.rejected)) > seq_len for t in kept)
    dataset.facts = {"records": len(kept), "tokens": int(dataset.attention_mask.sum()), "truncated": truncated,
                     "dropped": dropped, "rows": 2 * len(kept)}
    return dataset


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
    return TokenDataset(input_ids=ids, labels=labels, attention_mask=attention, rows_per_item=2)
