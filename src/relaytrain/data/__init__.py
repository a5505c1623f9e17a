"""Data sources -> a `TokenDataset` -> a `MicroBatchLoader` of minibatches.

`data.source` picks the source, a class registered by name in `data/sources/` (`source(name)`,
looked up once for a run: `relaytrain.run.resolve`, which hands it over with the objective and
family, `build_datasets`):
`synthetic` (the embedded default), `jsonl` (text or token records), `chat` (conversations or
instructions), both from data.path in any form (`reading.py`) or a mixture (data.mix), `glue` /
`wikitext` (the Hugging Face hub, or a local copy via data.path). What a source shares with the
others: `reading.py` (files, globs, `datasets` directories, the hub), `samples.py` (a sample and its checks), `encode.py` (tokens to tensors), `labels.py` (what the
model's task asks of the data), `tokenizer.py`, `mixture.py` (data.mix); `cache.py`, the
tokenize cache every source but the generated one goes through; `stream.py`, data.streaming.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from relaytrain.data.cache import prepared
from relaytrain.data.dataset import MicroBatchLoader, TokenDataset, eval_batches, hold_out
from relaytrain.data.sources import DataSource
from relaytrain.data.sources import source as named_source
from relaytrain.data.stream import StreamedSet, StreamLoader
from relaytrain.utils.errors import ConfigError

if TYPE_CHECKING:
    from relaytrain.models.family import Family
    from relaytrain.objectives.base import Objective

__all__ = ["MicroBatchLoader", "TokenDataset", "build_dataset", "build_datasets", "build_loader", "data_facts",
           "eval_batches", "load_source"]


def build_datasets(cfg, tokenizer_dir: str | None = None, source: type[DataSource] | None = None,
                   objective: Objective | None = None, family: Family | None = None
                   ) -> tuple[TokenDataset, TokenDataset | None]:
    """The training set `cfg.data` describes, tokenized for `cfg.model` (or read from the tokenize
    cache, `data/cache.py`), and its held-out set (None without one): the source's own
    (data.eval_path, data.eval_split), or data.eval_fraction of the samples, held out by a seeded draw.

    `tokenizer_dir`: where a tokenizer trained here is saved (the run directory), so that a
    saved model ships with the tokenizer it was trained with. `source`, `objective`, `family`:
    the run's, resolved (`relaytrain.run.resolve`); looked up by name when not given (a caller
    that holds only the config). The training set's `facts` say what preparing it found and took
    (results.json's `data`, `data_facts`).
    """
    d = cfg.data
    start = time.perf_counter()
    chosen, objective, family = _named(cfg, source, objective, family)
    if d.streaming:  # read as it trains (data/stream.py): nothing to cache, nothing counted ahead
        train, held_out = chosen.stream(cfg, tokenizer_dir, objective, family)
        train.facts = {**train.facts, "cache": "off", "prepare_s": round(time.perf_counter() - start, 3)}
        if held_out is not None:
            held_out.facts = _counted(held_out)
        return train, held_out
    inputs = chosen.inputs(cfg)  # what the tokenize cache fingerprints (generated data: nothing)
    train, held_out, status = prepared(cfg, inputs, chosen.chat_template, tokenizer_dir,
                                       lambda directory: chosen.load(cfg, directory, objective, family),
                                       objective, family)
    if held_out is None and d.eval_fraction > 0:
        train, held_out = hold_out(train, d.eval_fraction, d.seed)
    if held_out is not None and len(held_out) == 0:
        raise ConfigError("the held-out set is empty; raise data.eval_fraction or give more held-out samples")
    train.facts = {"source": chosen.name, **_counted(train), "cache": status,
                   "prepare_s": round(time.perf_counter() - start, 3)}
    if held_out is not None:
        held_out.facts = _counted(held_out)
    return train, held_out


def _named(cfg, source, objective, family) -> tuple[type[DataSource], Objective, Family]:
    """The run's source, objective and family as given, else as the config names them (for a
    caller without the run's resolved ones: tests, scripts, notebooks)."""
    from relaytrain.models.family import family_spec
    from relaytrain.objectives import objective as objective_named

    return (source or named_source(cfg.data.source), objective or objective_named(cfg.objective.name),
            family or family_spec(cfg.model.family))


def _counted(dataset: TokenDataset) -> dict:
    """The source's facts with the counts every set reports (records, tokens, truncated, dropped),
    taken from the rows where the source counted none (generated data)."""
    real = dataset.input_ids.numel() if dataset.attention_mask is None else int(dataset.attention_mask.sum())
    return {"records": len(dataset), "tokens": real, "truncated": 0, "dropped": 0, **dataset.facts}


def load_source(cfg, tokenizer_dir: str | None = None) -> TokenDataset:
    """The training set exactly as the source reads it (nothing held out by data.eval_fraction, no cache)."""
    chosen, objective, family = _named(cfg, None, None, None)
    return chosen.load(cfg, tokenizer_dir, objective, family)[0]


def build_dataset(cfg, tokenizer_dir: str | None = None) -> TokenDataset:
    """The training set `cfg.data` describes (see `build_datasets`)."""
    return build_datasets(cfg, tokenizer_dir)[0]


def data_facts(train: TokenDataset, held_out: TokenDataset | None) -> dict:
    """What preparing the data found, for results.json: `{"data": {source, records, tokens,
    truncated, dropped, cache, prepare_s, ..., "eval": {...}}}`."""
    facts = dict(train.facts)
    if held_out is not None and held_out.facts:
        facts["eval"] = dict(held_out.facts)
    return {"data": facts} if facts else {}


def build_loader(cfg, dataset: TokenDataset | StreamedSet, replicas: int = 1) -> MicroBatchLoader | StreamLoader:
    """Minibatches of `replicas` shares: each micro-batch holds every replica's rows (a streamed
    set's loader serves the same minibatches as it reads)."""
    s = cfg.strategy
    loader = StreamLoader if isinstance(dataset, StreamedSet) else MicroBatchLoader
    return loader(dataset, s.microbatch_size * replicas, s.num_microbatches, cfg.data.shuffle, cfg.data.seed,
                  dropout_seed=cfg.train.seed, replicas=replicas)
