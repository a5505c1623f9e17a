"""Where records come from, read through `datasets` whatever form the user has them in.

A location (data.path, data.eval_path, an entry of data.mix) is one of:

- a file: JSON lines or JSON (`.jsonl`, `.json`), Parquet, Arrow (`.arrow`, as `save_to_disk`
  writes its shards), CSV, or plain text (`.txt`, one record per line, column `text`);
- a glob of such files (`data/*.parquet`), read in sorted order as one set;
- a directory: one written by `Dataset(Dict).save_to_disk` (its split: data.split), else the
  data files directly inside it;
- anything else is a Hugging Face hub id (`datasets.load_dataset`, with data.name and data.split).

`read_records` returns the rows as a `Records`: the `datasets.Dataset` and where each row came
from (`Where`: "FILE line N" for JSON lines, "LOCATION row N" otherwise), so a bad record is one
line naming its file and row. `fingerprint` says what the content is without reading it as
records (the bytes of local files; the hub's own fingerprint), for the tokenize cache. Every
problem a user can fix (unreadable file, unreachable hub, missing split or column) is a one-line
`ConfigError` that names the fix.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from relaytrain.utils.errors import ConfigError, first_line

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# File endings -> the `datasets` builder that reads them.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}
FORMS = "a .jsonl/.json, .parquet, .arrow, .csv or .txt file, a glob of them, a `datasets` directory or a hub id"
# What `save_to_disk` leaves in the directory it writes (a Dataset, or a DatasetDict).
SAVED_MARKERS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Where:
    """Where one record is, for error messages. JSON lines name the file's line (blank lines
    count, as an editor counts them); other forms the row, from 1."""

    location: str
    row: int  # from 0, in the order `datasets` reads the rows
    lines_of: tuple[str, ...] = ()  # the JSON lines files the rows came from, in order

    def __str__(self) -> str:
        line = _line_of(self.lines_of, self.row) if self.lines_of else None
        return f"{line[0]} line {line[1]}" if line else f"{self.location} row {self.row + 1}"


@dataclass
class Records:
    """The rows at one location (a `datasets.Dataset`) and how to say where each is."""

    location: str  # as the user wrote it
    table: object  # datasets.Dataset
    json_lines: tuple[str, ...] = ()  # the files, when every one is JSON lines

    def __len__(self) -> int:
        return len(self.table)

    def where(self, row: int) -> Where:
        return Where(self.location, row, self.json_lines)

    def rows(self) -> list[tuple[Where, dict]]:
        return [(self.where(row), record) for row, record in enumerate(self.table.to_list())]

    def require_columns(self, columns: list[str], fix: str) -> None:
        for column in columns:
            if column not in self.table.column_names:
                raise ConfigError(f"{self.location} has no column {column!r} (it has "
                                  f"{', '.join(self.table.column_names)}); {fix}")


# --------------------------------------------------------------------------- locating


@dataclass(frozen=True)
class Located:
    kind: str  # "files", "saved" (a save_to_disk directory) or "hub"
    files: tuple[Path, ...] = ()


def locate(location: str, key: str) -> Located:
    """What `location` is; a local path that names nothing is one line, before any work."""
    path = Path(location).expanduser()
    if glob.has_magic(location):
        files = tuple(Path(f) for f in sorted(glob.glob(str(path), recursive=True)) if Path(f).is_file())
        if not files:
            raise ConfigError(f"{key}={location} matches no file; check the pattern")
        return Located("files", files)
    if path.is_file():
        return Located("files", (path,))
    if path.is_dir():
        if any((path / marker).is_file() for marker in SAVED_MARKERS):
            return Located("saved", tuple(sorted(p for p in path.rglob("*") if p.is_file())))
        files = tuple(sorted(p for p in path.iterdir() if p.is_file() and _ending(p) in BUILDERS))
        if not files:
            raise ConfigError(f"{key}={location} is not a `datasets` directory (save_to_disk) and holds no data "
                              f"files; give {FORMS}")
        return Located("files", files)
    if _looks_local(location):
        raise ConfigError(f"{key}={location} does not exist; give {FORMS}")
    return Located("hub")


def _looks_local(location: str) -> bool:
    """A path, not a hub id ("owner/name" or "name"): absolute, relative to here or home, or a file name."""
    return (location.startswith(("/", ".", "~")) or _ending(Path(location)) in BUILDERS
            or location.count("/") > 1 or os.sep != "/" and os.sep in location)


def _ending(path: Path) -> str:
    return path.suffix.lower()


def check_location(location: str | None, key: str, example: str = "/path/to/train.jsonl") -> None:
    """The config check: the key is set, and a local location exists (a hub id is tried at load)."""
    if not location:
        raise ConfigError(f"{key} is not set: give {FORMS}, e.g. {key}={example}")
    locate(location, key)


# --------------------------------------------------------------------------- reading


def read_records(location: str, key: str, split: str = "train", name: str | None = None,
                 split_key: str = "data.split") -> Records:
    """Every row at `location` (the split `split` of a `datasets` directory or a hub dataset)."""
    found = locate(location, key)
    if found.kind == "saved":
        return Records(location, split_from_disk(location, split, split_key))
    if found.kind == "hub":
        return Records(f"{location} split={split}", split_from_hub(location, name, split, split_key))
    _check_one_split(split, key, location, split_key)
    table = _from_files(location, key, found.files)
    json_lines = tuple(str(f) for f in found.files) if all(_ending(f) == ".jsonl" for f in found.files) else ()
    if json_lines and len(table) != _rows_in(json_lines):
        for file in found.files:  # `datasets` read a line as several rows: one holds a JSON array
            _diagnose_json(file, whole_document=False)
        json_lines = ()
    return Records(location, table, json_lines)


def stream_rows(location: str, key: str = "data.path", split: str = "train",
                name: str | None = None) -> Iterator[tuple[Where, dict]]:
    """The rows at `location` one at a time, with where each is (`datasets` in streaming mode:
    nothing is read ahead of the row asked for, nothing converted to Arrow first)."""
    found = locate(location, key)
    if found.kind == "saved":
        with quiet_datasets():
            table = split_from_disk(location, split, "data.split").to_iterable_dataset()
        records = Records(location, None)
    elif found.kind == "hub":
        table = split_from_hub(location, name, split, "data.split", streaming=True)
        records = Records(f"{location} split={split}", None)
    else:
        _check_one_split(split, key, location)
        table = _from_files(location, key, found.files, streaming=True)
        json_lines = tuple(str(f) for f in found.files) if all(_ending(f) == ".jsonl" for f in found.files) else ()
        records = Records(location, None, json_lines)
    return _rows_of(table, records, location, key, found.files)


def _rows_of(table, records: Records, location: str, key: str, files: tuple[Path, ...]):
    rows = iter(table)
    row = 0
    while True:
        try:
            with quiet_datasets():
                record = next(rows)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a stream fails where its bad part is read
            _cannot_read(e, location, key, files, "the stream")
        yield records.where(row), record
        row += 1


def _check_one_split(split: str, key: str, location: str, split_key: str = "data.split") -> None:
    if split != "train":  # `datasets` calls what files hold its train split, and they hold no other
        raise ConfigError(f"{split_key}={split} names a split, and {key}={location} is files, which hold one; "
                          f"give a `datasets` directory or hub dataset with that split, or the split's own files")


def _from_files(location: str, key: str, files: tuple[Path, ...], streaming: bool = False):
    import datasets

    builders = {BUILDERS.get(_ending(f)) for f in files}
    if None in builders or len(builders) > 1:
        endings = ", ".join(sorted({_ending(f) or "(none)" for f in files}))
        raise ConfigError(f"{key}={location} holds files ending in {endings}; give files of one kind: "
                          f"{', '.join(BUILDERS)}")
    builder = builders.pop()
    try:
        with quiet_datasets():
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                         streaming=streaming)
    except Exception as e:  # noqa: BLE001 - pyarrow, pandas and datasets each raise their own
        _cannot_read(e, location, key, files, builder)


def _cannot_read(e: Exception, location: str, key: str, files: tuple[Path, ...], what: str):
    """The one line for records `datasets` could not read: an empty file, the JSON line at fault, or its reason."""
    if files and all(not f.read_bytes().strip() for f in files):
        raise ConfigError(f"{key}={location} holds no samples (it is empty or blank); give a file of records, "
                          f"one a line in JSON lines") from e
    for file in files:
        if _ending(file) in (".jsonl", ".json"):
            _diagnose_json(file)  # names the line when one is not a JSON object
    raise ConfigError(f"{key}={location} cannot be read as {what} ({first_line(e.__cause__ or e)}); "
                      f"fix the file or give {FORMS}") from e


@contextlib.contextmanager
def quiet_datasets():
    """`datasets` without its progress bars and its own error log: a failure here becomes one line
    of ours, and a run's output is the run's."""
    import datasets
    from datasets.utils import are_progress_bars_disabled
    from datasets.utils import logging as datasets_logging

    verbosity, disabled = datasets_logging.get_verbosity(), are_progress_bars_disabled()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if not disabled:
            datasets.enable_progress_bars()


def _diagnose_json(file: Path, whole_document: bool = True) -> None:
    """The first line of a JSON lines file that is not a JSON object, as one line; nothing when
    every line is one (or, `whole_document`, the file is one JSON list of objects)."""
    if whole_document:
        try:
            whole = json.loads(file.read_bytes())
        except (ValueError, OSError):
            whole = None
        if isinstance(whole, list) and all(isinstance(item, dict) for item in whole):
            return
    for number, raw in enumerate(_raw_lines(str(file)), start=1):
        if not raw.strip():
            continue
        where = f"{file} line {number}"
        try:
            record = json.loads(raw)
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not UTF-8 text ({e.reason}); save the file as UTF-8") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); write one JSON object "
                              f"per line") from e
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object, got a {type(record).__name__}; write one object "
                              f"per line")


def _raw_lines(file: str) -> Iterator[bytes]:
    with open(file, "rb") as f:
        yield from f


def _record_lines(files: tuple[str, ...]) -> list[array]:
    """Per file, the line numbers of its non-blank lines: the rows `datasets` reads, in order."""
    stamps = tuple((os.stat(file).st_mtime_ns, os.stat(file).st_size) for file in files)
    return _lines_when(files, stamps)


@functools.lru_cache(maxsize=8)
def _lines_when(files: tuple[str, ...], stamps: tuple) -> list[array]:
    """`_record_lines` for the files as they were at `stamps`: a rewritten file is read again.
    Line numbers in a compact array: a corpus of millions of lines costs megabytes, not gigabytes."""
    return [array("Q", (number for number, raw in enumerate(_raw_lines(file), start=1) if raw.strip()))
            for file in files]


def _rows_in(files: tuple[str, ...]) -> int:
    return sum(len(lines) for lines in _record_lines(files))


def _line_of(files: tuple[str, ...], row: int) -> tuple[str, int] | None:
    """The file and line of a row; None where rows are not lines (a file that is one JSON array)."""
    for file, lines in zip(files, _record_lines(files), strict=True):
        if row < len(lines):
            return file, lines[row]
        row -= len(lines)
    return None


# --------------------------------------------------------------------------- fingerprints


class Input(NamedTuple):
    """One set of records a source reads: where, the key that names it, its split and config;
    `hub`: a hub dataset named by the source itself (never a local path)."""

    location: str
    key: str
    split: str = "train"
    name: str | None = None
    hub: bool = False


def fingerprint(given: Input) -> str:
    """What the content of `given` is, cheaply: a hash of the local files' bytes (a changed
    byte changes it, a touched file does not), or the hub dataset's own fingerprint."""
    location, split, name = given.location, given.split, given.name
    found = Located("hub") if given.hub else locate(location, given.key)
    if found.kind == "hub":
        return f"hub:{split_from_hub(location, name, split, 'data.split')._fingerprint}"
    digest = hashlib.blake2b(digest_size=16)
    for file in found.files:
        digest.update(str(file.relative_to(found.files[0].parent) if found.kind == "saved" else file.name).encode())
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    suffix = f":{split}" if found.kind == "saved" else ""
    return f"{found.kind}:{digest.hexdigest()}{suffix}"


# --------------------------------------------------------------------------- hub / local datasets


def load_split(cfg, hub_name: str, split: str):
    """The `datasets.Dataset` for `split` (data.split or data.eval_split) of a hub source: from
    data.path when set (any form `read_records` takes), else from the hub."""
    d = cfg.data
    key = "data.split" if split == d.split else "data.eval_split"
    if d.path:
        return read_records(d.path, "data.path", split, d.name, key).table
    return split_from_hub(hub_name, d.name, split, key)


def require_columns(split, columns: list[str], origin: str) -> None:
    for column in columns:
        if column not in split.column_names:
            raise ConfigError(
                f"{origin} has no column {column!r} (it has {', '.join(split.column_names)}); "
                f"set data.text_field / data.label_field to its columns, e.g. data.text_field=sentence1,sentence2"
            )


def split_from_disk(path: str, split: str, key: str):
    import datasets

    try:
        with quiet_datasets():
            loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    except FileNotFoundError as e:
        raise ConfigError(
            f"data.path={path} is not a `datasets` directory ({first_line(e)}); "
            f"write one with DatasetDict.save_to_disk, or give {FORMS}"
        ) from e
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded  # a single saved Dataset is the split
    if split not in loaded:
        raise ConfigError(
            f"data.path={path} has no split {split!r}; set {key} to one of {', '.join(loaded)}"
        )
    return loaded[split]


def split_from_hub(hub_name: str, name: str | None, split: str, key: str = "data.split", streaming: bool = False):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    dataset = f"{hub_name}/{name}" if name else hub_name
    # datasets reads the offline variables once, at import: when they were set later it would
    # still go to the network (and retry for tens of seconds), so refuse at once instead.
    if _offline_requested() and not datasets.config.HF_HUB_OFFLINE:
        raise ConfigError(_unreachable(dataset, "offline mode is set"))
    try:
        with quiet_datasets():
            return datasets.load_dataset(hub_name, name, split=split, streaming=streaming)
    except (ConnectionError, TimeoutError) as e:  # includes offline mode with nothing cached
        raise ConfigError(_unreachable(dataset, first_line(e))) from e
    except DatasetNotFoundError as e:
        raise ConfigError(f"{dataset} is no local path and was not found on the Hugging Face hub; check the "
                          f"name and data.name") from e
    except (OSError, ValueError) as e:  # unknown config name or split, broken cache
        raise ConfigError(
            f"cannot load {dataset} split={split} ({first_line(e)}); check data.name and {key}"
        ) from e


def _offline_requested() -> bool:
    return any(os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE") for var in OFFLINE_VARS)


def _unreachable(dataset: str, why: str) -> str:
    return (
        f"the Hugging Face hub is unreachable for {dataset} ({why}); set data.path=<local datasets dir> "
        f"(written by DatasetDict.save_to_disk) or use data=jsonl data.path=<file.jsonl>"
    )
