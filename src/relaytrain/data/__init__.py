"""Data sources -> a `TokenDataset` -> a `MicroBatchLoader` of minibatches.

`data.source` picks the source: `synthetic` (the embedded default), `jsonl` (a local file),
`glue` / `wikitext` (the Hugging Face hub, or a local `datasets` directory via data.path).
"""

from __future__ import annotations

from relaytrain.data.dataset import MicroBatchLoader, TokenDataset
from relaytrain.data.synthetic import synthetic_dataset

__all__ = ["MicroBatchLoader", "TokenDataset", "build_dataset", "build_loader"]


def build_dataset(cfg, tokenizer_dir: str | None = None) -> TokenDataset:
    """The dataset `cfg.data` describes, tokenized for `cfg.model`.

    `tokenizer_dir`: where a tokenizer trained here is saved (the run directory), so that a
    saved model ships with the tokenizer it was trained with.
    """
    d, m = cfg.data, cfg.model
    if d.source == "synthetic":
        return synthetic_dataset(m.task, d.num_samples, d.seq_len, m.vocab_size, m.num_labels, d.seed)
    from relaytrain.data.sources import load_source  # file and hub sources pull in `datasets`

    return load_source(cfg, tokenizer_dir)


def build_loader(cfg, dataset: TokenDataset, replicas: int = 1) -> MicroBatchLoader:
    """Minibatches of `replicas` shares: each micro-batch holds every replica's rows."""
    s = cfg.strategy
    return MicroBatchLoader(dataset, s.microbatch_size * replicas, s.num_microbatches, cfg.data.shuffle, cfg.data.seed)
