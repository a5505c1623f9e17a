"""`data=chat`: conversations or instructions in a local JSONL file (data.path; held out:
data.eval_path), rendered with the tokenizer's chat template and trained on the assistant's
replies only; data.pack packs short records into rows. The records, their rendering and packing
are `data/chat.py`'s."""

from __future__ import annotations

from relaytrain.data import labels
from relaytrain.data.chat import check_generation_prompt, encode_records, read_records
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.tokenizer import load_tokenizer
from relaytrain.errors import ConfigError
from relaytrain.models.family import family_spec


@register_source("chat")
class ChatSource(DataSource):
    origin = Origin.file
    packs = True

    @classmethod
    def load(cls, cfg, tokenizer_dir: str | None = None) -> tuple[TokenDataset, TokenDataset | None]:
        """The training set of data.path and the held-out set of data.eval_path (None without one),
        rendered with one tokenizer: the configured one, or ChatML trained on the training records."""
        _check_model(cfg)
        d = cfg.data
        files = [("data.path", d.path)] + ([("data.eval_path", d.eval_path)] if d.eval_path else [])
        groups = [(key, read_records(file, key)) for key, file in files]
        corpus = (text for record in groups[0][1] for m in record.messages for text in (m["role"], m["content"]))
        tokenizer = load_tokenizer(cfg, corpus, tokenizer_dir, chat=True)
        check_generation_prompt(tokenizer, groups[0][1][0])
        datasets = [encode_records(records, tokenizer, d.seq_len, d.pack, key) for key, records in groups]
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def _check_model(cfg) -> None:
    m = cfg.model
    if not labels.next_token_labels(m):
        raise ConfigError(f"data=chat trains a causal LM on the assistant's replies, not model.task={m.task}; "
                          f"use model.task=causal_lm with a model that has it (e.g. model=llama_tiny)")
    if cfg.data.pack and not family_spec(m.family).layered.packs_records:
        raise ConfigError(f"data.pack=true needs a model that keeps packed records apart by their positions, "
                          f"which model.family={m.family} does not; drop data.pack")
