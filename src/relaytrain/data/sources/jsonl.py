"""`data=jsonl`: a local file, one JSON object per line, holding text (`data.text_field`, "a,b"
for a text pair) or pre-tokenized `input_ids`, plus `data.label_field` for classification;
held-out samples in a second such file (data.eval_path)."""

from __future__ import annotations

import json

from relaytrain.data import labels
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.encode import encode_samples
from relaytrain.data.reading import read_lines
from relaytrain.data.samples import (
    MISSING,
    Sample,
    checked_label,
    checked_text,
    checked_token_ids,
    text_fields,
)
from relaytrain.data.sources import DataSource, Origin, register_source
from relaytrain.errors import ConfigError


@register_source("jsonl")
class JsonlSource(DataSource):
    origin = Origin.file

    @classmethod
    def load(cls, cfg, tokenizer_dir: str | None = None) -> tuple[TokenDataset, TokenDataset | None]:
        groups = [read_jsonl(cfg)]
        if cfg.data.eval_path:
            groups.append(read_jsonl(cfg, cfg.data.eval_path, "data.eval_path"))
        datasets = encode_samples(cfg, groups, tokenizer_dir)
        return datasets[0], (datasets[1] if len(datasets) > 1 else None)


def read_jsonl(cfg, file: str | None = None, key: str = "data.path") -> list[Sample]:
    """Every non-blank line of `file` (default data.path) as a checked `Sample`."""
    file = file if file is not None else cfg.data.path
    samples = [_parse_line(cfg, line, where) for where, line in read_lines(file, key, cfg.data.source)]
    if not samples:
        raise ConfigError(
            f"{key}={file} holds no samples (the file is empty or blank); write one JSON object per line, "
            f'e.g. {{"{cfg.data.text_field.split(",")[0]}": "...", "{cfg.data.label_field}": 0}}'
        )
    return samples


def _parse_line(cfg, line: str, where: str) -> Sample:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where}: malformed JSON ({e.msg} at column {e.colno}); write one JSON object per line"
        ) from e
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where}: expected a JSON object, got a {type(record).__name__}; "
            f'write one object per line, e.g. {{"text": "...", "label": 0}}'
        )
    sample = Sample(where)
    if "input_ids" in record:  # pre-tokenized wins over text: it is what the user asked the model to see
        sample.input_ids = checked_token_ids(record["input_ids"], where, cfg.model.vocab_size)
    else:
        sample.text = _record_text(record, where, cfg.data.text_field)
    if labels.class_labels(cfg.model):
        value = record.get(cfg.data.label_field, MISSING)
        sample.label = checked_label(value, where, cfg.data.label_field, cfg.model.num_labels)
    return sample


def _record_text(record: dict, where: str, text_field: str) -> tuple[str, ...]:
    fields = text_fields(text_field)
    for field in fields:
        if field not in record:
            raise ConfigError(
                f"{where}: no {field!r} text (data.text_field={text_field}) and no 'input_ids'; "
                f"add the field, or set data.text_field to the key that holds the text"
            )
    return tuple(checked_text(record[field], where, field) for field in fields)
