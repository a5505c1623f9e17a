"""`data=synthetic`, the embedded default: generated from data.seed (`data/synthetic.py`), needs
no file, tokenizer or network; held out: a share of it (data.eval_fraction)."""

from __future__ import annotations

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.synthetic import synthetic_dataset


@register_source("synthetic")
class SyntheticSource(DataSource):
    origin = Origin.generated
    gives_pairs = True  # items of the objective's rows (`synthetic_dataset`): what a preference run is planned on

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        d = cfg.data
        m = cfg.model
        return synthetic_dataset(objective, m.vocab_size, m.num_labels, d.num_samples, d.seq_len, d.seed), None
