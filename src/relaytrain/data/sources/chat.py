"""`data=chat`: conversations or instructions (OpenAI messages, ShareGPT, alpaca) at data.path in
any form `reading.py` takes, or mixed from several (data.mix); held out: data.eval_path (or
data.eval_split of a `datasets` directory or hub dataset). Rendered with the tokenizer's chat
template and trained on the assistant's replies only; data.pack packs short records into rows.
The records, their rendering and packing are `data/chat.py`'s."""

from __future__ import annotations

from collections.abc import Mapping

from relaytrain.data import labels
from relaytrain.data.chat import ROLES, TOOL, check_generation_prompt, encode_records, read_conversations
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.mixture import training_records
from relaytrain.data.reading import read_records
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.tokenizer import load_tokenizer
from relaytrain.errors import ConfigError
from relaytrain.models.family import family_spec


@register_source("chat")
class ChatSource(DataSource):
    origin = Origin.file
    packs = True
    chat_template = True

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        roles = cfg.data.roles
        if roles is not None and not isinstance(roles, Mapping):
            raise ConfigError(f"data.roles={roles} must be a mapping of names to roles, e.g. data.roles={{bot: assistant}}")
        for name, role in (roles or {}).items():
            if role not in (*ROLES, TOOL):
                raise ConfigError(f"data.roles.{name}={role} is no role; map each name to system, user, assistant "
                                  f"or tool")

    @classmethod
    def load(cls, cfg, tokenizer_dir: str | None = None) -> tuple[TokenDataset, TokenDataset | None]:
        """The training records (data.path or data.mix) and the held-out ones (None without any),
        rendered with one tokenizer: the configured one, or ChatML trained on the training records."""
        _check_model(cfg)
        d = cfg.data
        roles = dict(d.roles or {})

        def read(location: str, key: str, split: str, name: str | None):
            split_key = "data.eval_split" if split == d.eval_split else "data.split"
            return read_conversations(read_records(location, key, split, name, split_key), key, roles)

        train, mix = training_records(cfg, read)
        groups = [("data.mix" if mix else "data.path", train)]
        if d.eval_path:
            groups.append(("data.eval_path", read(d.eval_path, "data.eval_path", d.split, d.name)))
        elif d.eval_split:
            groups.append(("data.eval_split", read(d.path, "data.path", d.eval_split, d.name)))
        corpus = (text for record in train for m in record.messages for text in (m["role"], m["content"]))
        tokenizer = load_tokenizer(cfg, corpus, tokenizer_dir, chat=True)
        check_generation_prompt(tokenizer, train[0])
        datasets = [encode_records(records, tokenizer, d.seq_len, d.pack, key, d.num_proc) for key, records in groups]
        if mix:
            datasets[0].facts["mix"] = mix
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def _check_model(cfg) -> None:
    m = cfg.model
    if not labels.next_token_labels(m):
        raise ConfigError(f"data=chat trains a causal LM on the assistant's replies, not model.task={m.task}; "
                          f"use model.task=causal_lm with a model that has it (e.g. model=llama_tiny)")
    if cfg.data.pack and not family_spec(m.family).layered.packs_records:
        raise ConfigError(f"data.pack=true needs a model that keeps packed records apart by their positions, "
                          f"which model.family={m.family} does not; drop data.pack")
