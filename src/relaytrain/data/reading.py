"""Where the sources' bytes come from: a local JSONL file's lines (jsonl, chat), or a split of a
Hugging Face dataset (glue, wikitext) from a local `datasets` directory (data.path, written by
`DatasetDict.save_to_disk`) or the hub. Every problem a user can fix (unreadable file,
unreachable hub, missing split or column) is a one-line `ConfigError` that names the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from relaytrain.errors import ConfigError, first_line

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def read_lines(file: str | None, key: str, source: str) -> list[tuple[str, str]]:
    """Every non-blank line of the JSONL file `key` names, with where it is ("PATH line N")."""
    if not file:
        raise ConfigError(f"data={source} needs a file: set {key}=/path/to/file.jsonl")
    path = Path(file).expanduser()
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ConfigError(
            f"{key}={file} cannot be read ({e.strerror}); point {key} at a JSONL file"
        ) from e
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        where = f"{path} line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not UTF-8 text ({e.reason}); save the file as UTF-8") from e
        if line.strip():
            lines.append((where, line))
    return lines


# --------------------------------------------------------------------------- hub / local datasets


def load_split(cfg, hub_name: str, split: str):
    """The `datasets.Dataset` for `split` (data.split or data.eval_split): from data.path when set,
    else from the hub."""
    d = cfg.data
    key = "data.split" if split == d.split else "data.eval_split"
    if d.path:
        return _split_from_disk(d.path, split, key)
    return _split_from_hub(hub_name, d.name, split)


def require_columns(split, columns: list[str], origin: str) -> None:
    for column in columns:
        if column not in split.column_names:
            raise ConfigError(
                f"{origin} has no column {column!r} (it has {', '.join(split.column_names)}); "
                f"set data.text_field / data.label_field to its columns, e.g. data.text_field=sentence1,sentence2"
            )


def _split_from_disk(path: str, split: str, key: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    except FileNotFoundError as e:
        raise ConfigError(
            f"data.path={path} is not a `datasets` directory ({first_line(e)}); "
            f"write one with DatasetDict.save_to_disk, or use data=jsonl"
        ) from e
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded  # a single saved Dataset is the split
    if split not in loaded:
        raise ConfigError(
            f"data.path={path} has no split {split!r}; set {key} to one of {', '.join(loaded)}"
        )
    return loaded[split]


def _split_from_hub(hub_name: str, name: str | None, split: str):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    dataset = f"{hub_name}/{name}" if name else hub_name
    # datasets reads the offline variables once, at import: when they were set later it would
    # still go to the network (and retry for tens of seconds), so refuse at once instead.
    if _offline_requested() and not datasets.config.HF_HUB_OFFLINE:
        raise ConfigError(_unreachable(dataset, "offline mode is set"))
    try:
        return datasets.load_dataset(hub_name, name, split=split)
    except (ConnectionError, TimeoutError) as e:  # includes offline mode with nothing cached
        raise ConfigError(_unreachable(dataset, first_line(e))) from e
    except DatasetNotFoundError as e:
        raise ConfigError(f"{dataset} was not found on the Hugging Face hub; check data.name") from e
    except (OSError, ValueError) as e:  # unknown config name or split, broken cache
        raise ConfigError(
            f"cannot load {dataset} split={split} ({first_line(e)}); check data.name and data.split"
        ) from e


def _offline_requested() -> bool:
    return any(os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE") for var in OFFLINE_VARS)


def _unreachable(dataset: str, why: str) -> str:
    return (
        f"the Hugging Face hub is unreachable for {dataset} ({why}); set data.path=<local datasets dir> "
        f"(written by DatasetDict.save_to_disk) or use data=jsonl data.path=<file.jsonl>"
    )
