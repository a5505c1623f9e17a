"""`data=chat`: conversations or instructions (OpenAI messages, ShareGPT, alpaca) at data.path in
any form `reading.py` takes, or mixed from several (data.mix); held out: data.eval_path (or
data.eval_split of a `datasets` directory or hub dataset). Rendered with the tokenizer's chat
template and trained on the assistant's replies only; data.pack packs short records into rows;
data.streaming renders them as it trains (`ChatRows`). The records, their rendering and packing
are `data/chat.py`'s."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import islice

import torch

from relaytrain.data import labels
from relaytrain.data.chat import (
    ROLES,
    TOOL,
    check_generation_prompt,
    encode_records,
    fit,
    one_per_row,
    packed,
    packed_tensors,
    parse_records,
    read_conversations,
    render,
)
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import special_ids
from relaytrain.data.mixture import training_records
from relaytrain.data.reading import Where, read_records, stream_rows
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.stream import StreamedSet, StreamRows, streamed_facts
from relaytrain.data.tokenizer import find_tokenizer, load_tokenizer
from relaytrain.utils.errors import ConfigError


@register_source("chat")
class ChatSource(DataSource):
    origin = Origin.file
    packs = True
    chat_template = True
    streams = True

    @classmethod
    def check(cls, cfg, objective) -> None:
        super().check(cfg, objective)
        roles = cfg.data.roles
        if roles is not None and not isinstance(roles, Mapping):
            raise ConfigError(f"data.roles={roles} must be a mapping of names to roles, e.g. data.roles={{bot: assistant}}")
        for name, role in (roles or {}).items():
            if role not in (*ROLES, TOOL):
                raise ConfigError(f"data.roles.{name}={role} is no role; map each name to system, user, assistant "
                                  f"or tool")

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        """The training records (data.path or data.mix) and the held-out ones (None without any),
        rendered with one tokenizer: the configured one, or ChatML trained on the training records."""
        _check_model(cfg, objective, family)
        d = cfg.data
        train, mix = training_records(cfg, lambda *where: _read(d, *where))
        groups = [("data.mix" if mix else "data.path", train), *_held_out(d)]
        corpus = (text for record in train for m in record.messages for text in (m["role"], m["content"]))
        tokenizer = load_tokenizer(cfg, corpus, tokenizer_dir, family, chat=True)
        check_generation_prompt(tokenizer, train[0])
        datasets = [encode_records(records, tokenizer, d.seq_len, d.pack, key, d.num_proc) for key, records in groups]
        if mix:
            datasets[0].facts["mix"] = mix
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)

    @classmethod
    def stream(cls, cfg, tokenizer_dir, objective, family) -> tuple[StreamedSet, TokenDataset | None]:
        """data.streaming: the training records as a stream rendered as it is read (`ChatRows`),
        the held-out ones in memory, both with the configured tokenizer, saved with the run."""
        _check_model(cfg, objective, family)
        d = cfg.data
        tokenizer = load_tokenizer(cfg, iter(()), tokenizer_dir, family, chat=True)
        first = stream_rows(d.path, "data.path", d.split, d.name)
        for record in parse_records(islice(first, 1), dict(d.roles or {})):
            check_generation_prompt(tokenizer, record)  # on the first record, as for the whole set
        held_out = [encode_records(records, tokenizer, d.seq_len, d.pack, key, d.num_proc)
                    for key, records in _held_out(d)]
        return StreamedSet(cfg, streamed_facts(cls.name), ChatRows()), (held_out[0] if held_out else None)


class ChatRows(StreamRows):
    """A streamed chat set's rows, made as `encode_records` makes the whole set's: each record
    rendered as it is read, cut to data.seq_len (or dropped when no reply token survives), then
    one a row or packed in order. A resume renders the records it skips: whether one is dropped,
    and where a packed row ends, is known only rendered."""

    unit = "rows (its records within data.seq_len, packed or one a row)"

    def tokenizer(self, cfg):
        return find_tokenizer(cfg, chat=True)

    def rows(self, cfg, records: Iterator[tuple[Where, dict]], tokenizer) -> Iterator:
        d = cfg.data
        rendered = (render(tokenizer, record) for record in parse_records(records, dict(d.roles or {})))
        kept = (fitted for fitted in (fit(ids, labels, d.seq_len) for ids, labels in rendered) if fitted)
        return packed(kept, d.seq_len) if d.pack else kept

    def encode(self, cfg, rows: list, tokenizer) -> TokenDataset:
        pad = special_ids(tokenizer).pad
        if cfg.data.pack:
            return packed_tensors(rows, cfg.data.seq_len, pad)
        dataset = one_per_row(rows, cfg.data.seq_len, pad)
        if dataset.attention_mask is None:  # a minibatch of full rows, whose neighbours may be padded
            dataset.attention_mask = torch.ones_like(dataset.input_ids)
        return dataset


def _read(d, location: str, key: str, split: str, name: str | None):
    split_key = "data.eval_split" if split == d.eval_split else "data.split"
    return read_conversations(read_records(location, key, split, name, split_key), key, dict(d.roles or {}))


def _held_out(d) -> list[tuple[str, list]]:
    """The held-out records cfg.data (`d`) names, with the key they came from: none, or one set."""
    if d.eval_path:
        return [("data.eval_path", _read(d, d.eval_path, "data.eval_path", d.split, d.name))]
    if d.eval_split:
        return [("data.eval_split", _read(d, d.path, "data.path", d.eval_split, d.name))]
    return []


def _check_model(cfg, objective, family) -> None:
    """The run's model (its `objective` and `family`) trains on chat records, packed if asked."""
    m = cfg.model
    if not labels.next_token_labels(objective):
        raise ConfigError(f"data=chat trains a causal LM on the assistant's replies, not model.task={m.task}; "
                          f"use model.task=causal_lm with a model that has it (e.g. model=llama_tiny)")
    if cfg.data.pack and not family.layered.packs_records:
        raise ConfigError(f"data.pack=true needs a model that keeps packed records apart by their positions, "
                          f"which model.family={m.family} does not; drop data.pack")
