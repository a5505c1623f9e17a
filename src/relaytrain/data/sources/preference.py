"""`data=preference`: preference pairs (a prompt, a chosen and a rejected completion; TRL's forms,
text or conversations, the prompt explicit or implicit) at data.path in any form `reading.py`
takes, or mixed from several (data.mix); held out: data.eval_path (or data.eval_split of a
`datasets` directory or hub dataset). Tokenized as TRL's DPOTrainer does, into two rows a pair
(`rows_per_item=2`), for an objective that compares them. The records, their tokenizing and
rows are `data/preference.py`'s."""

from __future__ import annotations

import copy

from omegaconf import OmegaConf

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.mixture import training_records
from relaytrain.data.preference import Pair, encode_pairs, read_pairs
from relaytrain.data.reading import read_records
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.tokenizer import load_tokenizer
from relaytrain.utils.errors import ConfigError

PAIR_ROWS = 2  # a pair's rows: its chosen, then its rejected


@register_source("preference")
class PreferenceSource(DataSource):
    origin = Origin.file
    chat_template = True  # conversations are rendered with it; it decides which tokenizer is used (and keyed)

    @classmethod
    def check(cls, cfg, objective) -> None:
        if cfg.data.pack:  # before the base's rule, whose fix (data=chat) is no fix for pairs
            raise ConfigError("data.pack=true packs records into rows; data=preference keeps each pair's chosen and "
                              "rejected rows whole and side by side, never packed: drop data.pack")
        super().check(cfg, objective)
        check_compares_pairs(objective)

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        """The training pairs (data.path or data.mix) and the held-out ones (None without any),
        tokenized with one tokenizer: the configured one, or one trained on the training pairs."""
        check_compares_pairs(objective)
        d = cfg.data
        train, mix = training_records(cfg, lambda *where: _read(d, *where))
        groups = [("data.mix" if mix else "data.path", train), *_held_out(d)]
        tokenizer = _tokenizer(cfg, [pair for _, pairs in groups for pair in pairs], tokenizer_dir, family)
        datasets = [encode_pairs(pairs, tokenizer, d.seq_len, key) for key, pairs in groups]
        if mix:
            datasets[0].facts["mix"] = mix
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def check_compares_pairs(objective) -> None:
    """Pairs are for an objective that compares a chosen and a rejected row (its `rows_per_item` is 2)."""
    if objective.rows_per_item != PAIR_ROWS:
        raise ConfigError(f"data=preference gives chosen/rejected pairs, and the objective {objective.name} trains "
                          f"on one sequence at a time; use objective=dpo (or another that compares pairs)")


def _tokenizer(cfg, pairs: list[Pair], tokenizer_dir, family):
    """Conversations need a chat template, as for data=chat; text needs none (a base model's
    tokenizer serves), but is the same tokenizer the cache keys: data.tokenizer before
    model.pretrained's, the chat rule (`tokenizer_location`)."""
    corpus = (text for pair in pairs for text in pair.texts())
    if any(pair.conversational for pair in pairs):
        return load_tokenizer(cfg, corpus, tokenizer_dir, family, chat=True)
    if cfg.data.tokenizer:
        cfg = copy.deepcopy(cfg)
        OmegaConf.update(cfg, "model.pretrained", None, merge=False)
    return load_tokenizer(cfg, corpus, tokenizer_dir, family)


def _read(d, location: str, key: str, split: str, name: str | None) -> list[Pair]:
    split_key = "data.eval_split" if split == d.eval_split else "data.split"
    return read_pairs(read_records(location, key, split, name, split_key), key)


def _held_out(d) -> list[tuple[str, list[Pair]]]:
    """The held-out pairs cfg.data (`d`) names, with the key they came from: none, or one set."""
    if d.eval_path:
        return [("data.eval_path", _read(d, d.eval_path, "data.eval_path", d.split, d.name))]
    if d.eval_split:
        return [("data.eval_split", _read(d, d.path, "data.path", d.eval_split, d.name))]
    return []
