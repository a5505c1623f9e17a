"""`data=jsonl`: records holding text (`data.text_field`, "a,b" for a text pair) or pre-tokenized
`input_ids`, plus `data.label_field` for classification, at data.path in any form `reading.py`
takes (JSON lines, JSON, parquet, arrow, csv, text, a glob, a `datasets` directory, a hub id) or
mixed from several (data.mix); held-out records at data.eval_path (or data.eval_split of a
`datasets` directory or hub dataset)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import encode_rows, encode_samples
from relaytrain.data.mixture import training_records
from relaytrain.data.reading import read_records
from relaytrain.data.samples import Sample, parse_sample
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.data.stream import StreamedSet, StreamRows, streamed_facts
from relaytrain.data.tokenizer import load_tokenizer
from relaytrain.utils.errors import ConfigError

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective


@register_source("jsonl")
class JsonlSource(DataSource):
    origin = Origin.file
    streams = True

    @classmethod
    def stream(cls, cfg, tokenizer_dir, objective, family) -> tuple[StreamedSet, TokenDataset | None]:
        """data.streaming: the training records as a stream (`data/stream.py`), the held-out ones
        (data.eval_path) in memory, both with the configured tokenizer, saved with the run."""
        d = cfg.data
        tokenizer = load_tokenizer(cfg, iter(()), tokenizer_dir, family)
        held_out = None
        if d.eval_path or d.eval_split:
            location, key, split = (d.eval_path, "data.eval_path", d.split) if d.eval_path else (
                d.path, "data.path", d.eval_split)
            held_out = encode_rows(cfg, read_samples(cfg, objective, location, key, split, d.name), tokenizer, objective)
        return StreamedSet(cfg, streamed_facts(cls.name), StreamRows(objective)), held_out

    @classmethod
    def load(cls, cfg, tokenizer_dir, objective, family) -> tuple[TokenDataset, TokenDataset | None]:
        d = cfg.data

        def read(location: str, key: str, split: str, name: str | None) -> list[Sample]:
            return read_samples(cfg, objective, location, key, split, name)

        train, mix = training_records(cfg, read)
        groups = [train]
        if d.eval_path:
            groups.append(read(d.eval_path, "data.eval_path", d.split, d.name))
        elif d.eval_split:
            groups.append(read(d.path, "data.path", d.eval_split, d.name))
        datasets = encode_samples(cfg, groups, tokenizer_dir, objective, family)
        if mix:
            datasets[0].facts["mix"] = mix
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def read_samples(cfg, objective: Objective, location: str, key: str = "data.path", split: str = "train",
                 name: str | None = None) -> list[Sample]:
    """Every record at `location` as a checked `Sample` (labelled where the run's `objective` classifies)."""
    records = read_records(location, key, split, name, "data.eval_split" if split == cfg.data.eval_split else
                           "data.split")
    samples = [parse_sample(cfg, record, where, objective) for where, record in records.rows()]
    if not samples:
        raise ConfigError(
            f"{key}={location} holds no samples (it is empty or blank); write one record per line, "
            f'e.g. {{"{cfg.data.text_field.split(",")[0]}": "...", "{cfg.data.label_field}": 0}}'
        )
    return samples
