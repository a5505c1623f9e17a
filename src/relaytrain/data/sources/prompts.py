"""`data=prompts`: prompts alone, for an objective that learns online (`Objective.learns_online`:
one whose rollout stage samples completions for them as it trains, scores them with reward
functions and makes its rows from them; TRL's GRPOTrainer). Read from data.path in any form
`reading.py` takes, or mixed from several (data.mix); held out: data.eval_path (or
data.eval_split of a `datasets` directory or hub dataset), as for data=preference.

A record is `{"prompt": "..."}` (text) or `{"prompt": [{"role": "user", "content": "..."}]}` (a
conversation: system, user and assistant turns, the last not the assistant's), one form a file
(the first record fixes it, and a record of the other is one line naming both), and any other
columns (an `answer`, a `solution`), which go to the reward functions as they are.

Tokenized as TRL 1.16's GRPOTrainer does (`_tokenize_prompts`): text with the tokenizer's own
special tokens (`tokenizer(text=prompt)`), a conversation with the chat template and its
generation prompt; never cut. TRL's sequences are as long as their prompt and completion make
them; a row here is data.seq_len long, so a prompt longer than data.seq_len -
objective.max_completion_length tokens, which leaves its completion no room, is dropped and
counted in `facts` (`dropped`).

Rows: one a prompt, `input_ids` the prompt's tokens and then the tokenizer's pad id (right
padding) to data.seq_len, `attention_mask` 1 on the prompt's tokens, `labels` -100 everywhere
(nothing is learnt from a prompt; the rollout stage labels the completions), `record` the prompt's
index in the set's `records`: one plain dict a kept prompt, `{"prompt": <as written>, "where":
"<file> line N", <every other column>}`, plain JSON values only (the tokenize cache stores them,
the reward functions read them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from relaytrain.data.chat import REPLY, ROLES
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import pad_rows, special_ids
from relaytrain.data.labels import IGNORE_INDEX
from relaytrain.data.mixture import training_records
from relaytrain.data.preference import (
    CONVERSATION,
    TEXT,
    Record,
    _chat_ids,
    _kind,
    read_parsed,
)
from relaytrain.data.reading import Records
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.sources.preference import _held_out, _read, _tokenizer
from relaytrain.utils.errors import ConfigError

EXAMPLE = '{"prompt": "What is 2+2?", "answer": "4"}'
PLACE = "where"  # a record's key for where it was read ("FILE line N"), beside its own columns


@dataclass
class Prompt(Record):
    """One prompt as read: where, its form (TEXT or CONVERSATION), the prompt as written, and the
    record's other columns."""

    columns: dict = field(default_factory=dict)
    # What TRL gives the chat template besides the messages: its trainer's tools and kwargs, not a record's.
    template_args: dict = field(default_factory=dict)
    noun: ClassVar[str] = "a prompt"

    def completions(self) -> tuple:
        return ()  # sampled as the run trains

    @property
    def conversational(self) -> bool:
        return self.form == CONVERSATION

    def record(self) -> dict:
        """What the rollout stage and the reward functions read: the prompt as written, where it
        was read, and every other column."""
        return {"prompt": self.prompt, PLACE: str(self.where), **self.columns}


@register_source("prompts")
class PromptsSource(DataSource):
    origin = Origin.file
    chat_template = True  # conversations are rendered with it; it decides which tokenizer is used (and keyed)
    gives_prompts = True

    @classmethod
    def check(cls, cfg, objective) -> None:
        if cfg.data.pack:  # before the base's rule, whose fix (data=chat) is no fix for prompts
            raise ConfigError(f"data.pack=true packs records into rows; data={cls.name} gives each prompt a row of "
                              f"its own, which its sampled completion fills: drop data.pack")
        super().check(cfg, objective)
        check_learns_online(objective)
        prompt_room(cfg.data.seq_len, completion_tokens(objective))

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        """The training prompts (data.path or data.mix) and the held-out ones (None without any),
        tokenized with one tokenizer: the configured one, or one trained on the prompts."""
        check_learns_online(objective)
        d = cfg.data
        completion = completion_tokens(objective)
        prompt_room(d.seq_len, completion)
        train, mix = training_records(cfg, lambda *where: _read(d, read_prompts, *where))
        groups = [("data.mix" if mix else "data.path", train), *_held_out(d, read_prompts)]
        tokenizer = _tokenizer(cfg, [prompt for _, prompts in groups for prompt in prompts], tokenizer_dir, family)
        datasets = [encode_prompts(prompts, tokenizer, d.seq_len, completion, key) for key, prompts in groups]
        if mix:
            datasets[0].facts["mix"] = mix
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def check_learns_online(objective) -> None:
    """Prompts are for an objective that samples its own completions; any other learns from rows given."""
    if objective.learns_online:
        return
    from relaytrain.objectives import objectives

    online = [f"objective={name}" for name, o in objectives().items() if o.learns_online and ":" not in name]
    fix = f"use {' or '.join(online)}" if online else "use an objective that learns online"
    raise ConfigError(f"data=prompts gives prompts for an objective that samples its own completions "
                      f"({' or '.join(online) or 'one that learns online'}); objective={objective.name} learns from "
                      f"the rows the data gives: {fix}, or data=chat (or another source of whole rows)")


def completion_tokens(objective) -> int:
    """The tokens the objective's rollouts may sample after a prompt (objective.max_completion_length)."""
    return int(getattr(objective, "max_completion_length", 0) or 0)


def prompt_room(seq_len: int, completion: int) -> int:
    """The tokens a prompt may take: what data.seq_len leaves beside the completion; none is one line."""
    room = seq_len - completion
    if room < 1:
        raise ConfigError(f"data.seq_len={seq_len} leaves no room for a prompt beside its completion "
                          f"(objective.max_completion_length={completion}); raise data.seq_len above {completion} "
                          f"or lower objective.max_completion_length")
    return room


# --------------------------------------------------------------------------- reading


def read_prompts(records: Records, key: str) -> list[Prompt]:
    """Every row of `records` as a checked `Prompt`, all of one form."""
    return read_parsed(records, key, parse_prompt, "prompt", EXAMPLE)


def parse_prompt(record, where) -> Prompt:
    """One record as a `Prompt` (`where` names it in every error)."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got a {type(record).__name__}; write e.g. {EXAMPLE}")
    prompt = record.get("prompt")
    if prompt is None:
        raise ConfigError(f"{where}: no 'prompt'; a record gives its prompt as text or as a list of turns "
                          f'[{{"role": "user", "content": ...}}], e.g. {EXAMPLE}')
    form = _kind(prompt, where, "prompt")
    if form == TEXT and not prompt:
        raise ConfigError(f"{where}: 'prompt' is empty; give the text the completions are sampled after")
    if form == CONVERSATION:
        _check_turns(prompt, where)
    if PLACE in record:
        raise ConfigError(f"{where}: a column named {PLACE!r}, which is where relaytrain's records say a prompt "
                          f"was read; rename the column")
    columns = {name: plain(value, where, name) for name, value in record.items() if name != "prompt"}
    return Prompt(where, form, plain(prompt, where, "prompt"), columns)


def _check_turns(turns: list[dict], where) -> None:
    """A prompt's turns are the system's, the user's and the assistant's, and it ends before a reply."""
    for number, turn in enumerate(turns, start=1):
        if turn["role"] not in ROLES:
            raise ConfigError(f"{where}: 'prompt' turn {number} has role {turn['role']!r}; a prompt's turns are "
                              f"{', '.join(ROLES)}")
    if turns[-1]["role"] == REPLY:
        raise ConfigError(f"{where}: 'prompt' ends with an assistant turn, and the completion sampled for it is the "
                          f"assistant's reply; end the prompt with a user (or system) turn")


def plain(value, where, name: str):
    """`value` as plain JSON values (text, numbers, true/false, null, lists, mappings with text
    keys), which the tokenize cache stores and the reward functions read; anything else (a date,
    bytes) is one line naming the column."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [plain(item, where, name) for item in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: plain(item, where, name) for k, item in value.items()}
    raise ConfigError(f"{where}: column {name!r} holds a {type(value).__name__}, and a prompt's columns are kept as "
                      f"plain values (text, numbers, true/false, null, lists, mappings) for the reward functions; "
                      f"store it as text, or drop the column")


# --------------------------------------------------------------------------- rows


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt's token ids as TRL's GRPOTrainer makes them (`_tokenize_prompts`): a conversation
    rendered by the chat template with the generation prompt, text with the tokenizer's special
    tokens (TRL calls it with its defaults); neither cut."""
    if prompt.conversational:
        return _chat_ids(tokenizer, prompt, prompt.prompt, generation_prompt=True)
    return list(tokenizer(text=prompt.prompt)["input_ids"])


def encode_prompts(prompts: list[Prompt], tokenizer, seq_len: int, completion: int, key: str) -> TokenDataset:
    """The prompts as rows of seq_len, one a prompt, with their records; a prompt longer than the
    room data.seq_len leaves beside `completion` tokens (objective.max_completion_length) dropped
    and counted in the facts, none left one line."""
    room = prompt_room(seq_len, completion)
    tokenized = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    kept = [(prompt, ids) for prompt, ids in zip(prompts, tokenized, strict=True) if len(ids) <= room]
    dropped = len(prompts) - len(kept)
    if not kept:
        longest = max(len(ids) for ids in tokenized)
        raise ConfigError(f"{key}: every prompt is longer than the {room} tokens data.seq_len={seq_len} leaves beside "
                          f"objective.max_completion_length={completion} (the longest has {longest}), so all "
                          f"{dropped} were dropped; raise data.seq_len to at least {longest + completion} or lower "
                          f"objective.max_completion_length")
    ids, attention = pad_rows([row for _, row in kept], seq_len, special_ids(tokenizer).pad)
    dataset = TokenDataset(input_ids=ids, labels=torch.full_like(ids, IGNORE_INDEX),
                           attention_mask=torch.ones_like(ids) if attention is None else attention,
                           record=torch.arange(len(kept)), records=[prompt.record() for prompt, _ in kept])
    dataset.facts = {"records": len(kept), "tokens": sum(len(row) for _, row in kept), "truncated": 0,
                     "dropped": dropped, "rows": len(kept)}
    return dataset
