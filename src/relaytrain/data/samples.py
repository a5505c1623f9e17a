"""One sample before tokenization, and the checks every sample-per-row source (jsonl, glue) runs
on what it reads: each failure a one-line `ConfigError` that says where and what to fix. A jsonl
record becomes a sample here (`parse_sample`), read whole or streamed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relaytrain.data import labels
from relaytrain.data.reading import Where
from relaytrain.utils.errors import ConfigError

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective

MISSING = object()  # a record without the field (None may be a value)


@dataclass
class Sample:
    """One sample before tokenization; `where` locates it for error messages."""

    where: Where | str
    text: tuple[str, ...] | None = None  # one text, or a pair
    input_ids: list[int] | None = None
    label: int | None = None


def text_fields(text_field: str) -> list[str]:
    """data.text_field's columns: one text, or two for a pair ("a,b")."""
    fields = [f.strip() for f in text_field.split(",") if f.strip()]
    if not 1 <= len(fields) <= 2:
        raise ConfigError(f"data.text_field={text_field} must name one text field, or two for a pair (a,b)")
    return fields


def checked_text(value, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{where}: {field!r} must be non-empty text, got {short(value)}; fix or remove the sample"
        )
    return value


def checked_label(value, where: str, field: str, num_labels: int) -> int:
    if value is MISSING:
        raise ConfigError(
            f"{where}: no {field!r} label, which model.task=classification needs on every sample; "
            f"add it, or set data.label_field to the key that holds it"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where}: label {short(value)} is not an integer; give class ids 0..{num_labels - 1}"
        )
    if not 0 <= value < num_labels:
        raise ConfigError(
            f"{where}: label {value} is outside [0, {num_labels}) (model.num_labels={num_labels}); "
            f"fix the label or raise model.num_labels"
        )
    return value


def checked_token_ids(value, where: str, vocab_size: int) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or any(isinstance(t, bool) or not isinstance(t, int) for t in value)
    ):
        raise ConfigError(f"{where}: input_ids must be a non-empty list of integers, got {short(value)}")
    for token in value:
        if not 0 <= token < vocab_size:
            raise ConfigError(
                f"{where}: token id {token} is outside [0, {vocab_size}) (model.vocab_size={vocab_size}); "
                f"re-tokenize with the model's vocabulary or raise model.vocab_size"
            )
    return value


def short(value) -> str:
    """`value` as JSON, cut to 40 characters: enough to recognise it in a one-line error."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_sample(cfg, record, where, objective: Objective) -> Sample:
    """One record (jsonl's: text or input_ids, and a label where the run's `objective`
    classifies) as a checked `Sample`."""
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where}: expected a JSON object, got a {type(record).__name__}; "
            f'write one object per line, e.g. {{"text": "...", "label": 0}}'
        )
    sample = Sample(where)
    if record.get("input_ids") is not None:  # pre-tokenized wins over text: it is what the user asked the model to see
        sample.input_ids = checked_token_ids(record["input_ids"], where, cfg.model.vocab_size)
    else:
        sample.text = _record_text(record, where, cfg.data.text_field)
    if labels.class_labels(objective):
        value = record.get(cfg.data.label_field)
        sample.label = checked_label(MISSING if value is None else value, where, cfg.data.label_field,
                                     cfg.model.num_labels)
    return sample


def _record_text(record: dict, where, text_field: str) -> tuple[str, ...]:
    fields = text_fields(text_field)
    for field in fields:
        if record.get(field) is None:
            raise ConfigError(
                f"{where}: no {field!r} text (data.text_field={text_field}) and no 'input_ids'; "
                f"add the field, or set data.text_field to the key that holds the text"
            )
    return tuple(checked_text(record[field], where, field) for field in fields)
