"""Data sources -> a `TokenDataset` -> a `MicroBatchLoader` of minibatches.

`data.source` picks the source, a class registered by name in `data/sources/` (`source(name)`):
`synthetic` (the embedded default), `jsonl` (a local file), `chat` (conversations or
instructions in a local file), `glue` / `wikitext` (the Hugging Face hub, or a local `datasets`
directory via data.path). What a source shares with the others: `reading.py` (files, the hub),
`samples.py` (a sample and its checks), `encode.py` (tokens to tensors), `labels.py` (what the
model's task asks of the data), `tokenizer.py`.
"""

from __future__ import annotations

from relaytrain.data.dataset import MicroBatchLoader, TokenDataset, eval_batches, hold_out
from relaytrain.data.sources import source
from relaytrain.errors import ConfigError

__all__ = ["MicroBatchLoader", "TokenDataset", "build_dataset", "build_datasets", "build_loader", "data_facts",
           "eval_batches", "load_source"]


def build_datasets(cfg, tokenizer_dir: str | None = None) -> tuple[TokenDataset, TokenDataset | None]:
    """The training set `cfg.data` describes, tokenized for `cfg.model`, and its held-out set
    (None without one): the source's own (data.eval_path, data.eval_split), or
    data.eval_fraction of the samples, held out by a seeded draw.

    `tokenizer_dir`: where a tokenizer trained here is saved (the run directory), so that a
    saved model ships with the tokenizer it was trained with.
    """
    d = cfg.data
    train, held_out = source(d.source).load(cfg, tokenizer_dir)
    if held_out is None and d.eval_fraction > 0:
        train, held_out = hold_out(train, d.eval_fraction, d.seed)
    if held_out is not None and len(held_out) == 0:
        raise ConfigError("the held-out set is empty; raise data.eval_fraction or give more held-out samples")
    return train, held_out


def load_source(cfg, tokenizer_dir: str | None = None) -> TokenDataset:
    """The training set exactly as the source reads it (nothing held out by data.eval_fraction)."""
    return source(cfg.data.source).load(cfg, tokenizer_dir)[0]


def build_dataset(cfg, tokenizer_dir: str | None = None) -> TokenDataset:
    """The training set `cfg.data` describes (see `build_datasets`)."""
    return build_datasets(cfg, tokenizer_dir)[0]


def data_facts(train: TokenDataset, held_out: TokenDataset | None) -> dict:
    """What reading the data found, for results.json: `{"data": {..., "eval": {...}}}` when the
    source reports anything (chat: records kept, truncated, dropped), else nothing."""
    facts = dict(train.facts)
    if held_out is not None and held_out.facts:
        facts["eval"] = dict(held_out.facts)
    return {"data": facts} if facts else {}


def build_loader(cfg, dataset: TokenDataset, replicas: int = 1) -> MicroBatchLoader:
    """Minibatches of `replicas` shares: each micro-batch holds every replica's rows."""
    s = cfg.strategy
    return MicroBatchLoader(dataset, s.microbatch_size * replicas, s.num_microbatches, cfg.data.shuffle, cfg.data.seed,
                            dropout_seed=cfg.train.seed)
