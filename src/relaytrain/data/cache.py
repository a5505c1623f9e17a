"""The tokenize cache: a source's tokenized sets kept on disk, reused while nothing they depend on
changes, so a large set is tokenized once (not at every start, nor by every process of a run).

An entry lives in `data.cache_dir` (default: `$XDG_CACHE_HOME/relaytrain/data`, i.e.
`~/.cache/relaytrain/data`) under a key hashed from everything the rows depend on (`cache_key`):
the content of every input (`reading.fingerprint`: the files' bytes, the hub's fingerprint), the
tokenizer (its files, chat template included, or what a tokenizer trained here is made from), the
data keys that shape rows (data.seq_len, data.pack, fields, roles, mixture weights, ...), what the
model's task asks of the labels, and `FORMAT`, raised whenever the code makes rows differently.
Keys that only order or split the rows afterwards (data.shuffle, data.eval_fraction) are not in it.

An entry holds the training and held-out sets as tensors, one a row field (`schema/row.py`,
integers in int32), their facts, and the tokenizer the source used, so a hit also gives the run
the tokenizer a saved model ships with. It is written to a staging directory and renamed into
place whole; a file lock on the key makes every other process of the run (torchrun starts each
with the same config) wait for the first to prepare it and then read it, so a set is tokenized
once. An entry that cannot be read back (a file cut short, damaged) is said in one line on
stderr and prepared again. Set data.cache=false to tokenize afresh and keep nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.reading import Input, fingerprint
from relaytrain.data.tokenizer import tokenizer_identity, tokenizer_location
from relaytrain.schema.row import FIELDS, Field
from relaytrain.utils.errors import ConfigError, first_line
from relaytrain.utils.files import write_json

if TYPE_CHECKING:
    from relaytrain.models.family import Family
    from relaytrain.objectives.base import Objective

FORMAT = 2  # raise when rows are made differently from the same inputs, or inputs once taken are refused
# (2: a chat file holds records of one form), so that old entries miss
# Data keys that do not change the tokenized rows: how they are ordered, held out or cached.
NOT_IN_KEY = ("shuffle", "shuffle_buffer", "eval_fraction", "cache", "cache_dir", "num_proc", "streaming", "seed")


ENV_DIR = "RELAYTRAIN_DATA_CACHE"  # the cache's folder where data.cache_dir is unset (a shared disk, a CI's scratch)


def default_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "relaytrain" / "data"


def cache_dir(d) -> Path:
    return cache_root(d.cache_dir)


def cache_root(configured: str | None) -> Path:
    """data.cache_dir (`configured`), or the default when it is unset."""
    return Path(configured).expanduser() if configured else default_dir()


def cache_key(cfg, inputs: list[Input], chat: bool, objective: Objective, family: Family) -> dict:
    """Everything the tokenized sets depend on, as a JSON-able dict (hashed into the entry's name):
    the source's `inputs` (`DataSource.inputs`), its tokenizer (`chat`: one with a chat template),
    the data keys, and what the run's `objective` and model (of `family`) ask of the labels."""
    from omegaconf import OmegaConf

    from relaytrain.data import labels

    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in NOT_IN_KEY}
    m = cfg.model
    if labels.masked_token_labels(objective):
        data["seed"] = cfg.data.seed  # which tokens are masked
    location = tokenizer_location(m.pretrained, cfg.data.tokenizer, chat)
    shaped = {"pairs": objective.pair_tokenization} if objective.rows_per_item > 1 else {}  # how a pair is tokenized
    if objective.learns_online:  # which prompts fit beside the longest completion (data=prompts drops the rest)
        shaped = {"completion_tokens": objective.max_completion_length}
    if objective.unpaired:  # KTO's KL rows pair each example with a neighbour in its micro-batch (data/preference.py)
        data["kl_group"] = cfg.strategy.microbatch_size
    return {
        "format": FORMAT,
        "inputs": [fingerprint(given) for given in inputs],
        "tokenizer": tokenizer_identity(location, family, m.vocab_size, m.max_seq_len, chat),
        "data": data,
        "labels": {"classes": labels.class_labels(objective), "next_token": labels.next_token_labels(objective),
                   "masked": labels.masked_token_labels(objective), "num_labels": m.num_labels,
                   "vocab_size": m.vocab_size, "family": family.name, "max_seq_len": m.max_seq_len, **shaped},
    }


def entry_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def prepared(cfg, inputs: list[Input], chat: bool, tokenizer_dir: str | None, load, objective: Objective,
             family: Family) -> tuple[TokenDataset, TokenDataset | None, str]:
    """A source's training and held-out sets, and "hit", "miss" or "off": read from the cache,
    or `load(tokenizer_dir)` and kept there (`inputs`, `chat`, `objective`, `family`: what
    `cache_key` keys them by). The tokenizer the source used is copied to
    `<tokenizer_dir>/tokenizer` either way."""
    if not cfg.data.cache or not inputs:
        train, held_out = load(tokenizer_dir)
        return train, held_out, "off"
    key = cache_key(cfg, inputs, chat, objective, family)
    root = cache_dir(cfg.data)
    entry = root / entry_name(key)
    try:
        (root / "locks").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"data.cache_dir={root} cannot be created ({e.strerror}); set data.cache_dir to a "
                          f"writable directory, or data.cache=false") from e
    with _locked(root / "locks" / entry.name):
        sets = _cached(entry)
        status = "miss" if sets is None else "hit"
        if sets is None:
            _write_entry(entry, key, load)
            sets = _read_entry(entry)
        train, held_out = sets
    if tokenizer_dir and (entry / "tokenizer").is_dir():
        shutil.copytree(entry / "tokenizer", Path(tokenizer_dir) / "tokenizer", dirs_exist_ok=True)
    return train, held_out, status


@contextlib.contextmanager
def _locked(path: Path):
    """Held by one process at a time; the kernel lets go when its holder ends, however it ends."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_entry(entry: Path, key: dict, load) -> None:
    # Under the key's lock nobody else writes this entry: staging left beside it was a crashed writer's.
    for leftover in entry.parent.glob(f"{entry.name}.staging-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.rmtree(entry, ignore_errors=True)  # an entry left without its data by a crash
    staging = entry.with_name(f"{entry.name}.staging-{os.getpid()}")
    staging.mkdir()
    try:
        train, held_out = load(str(staging))
        try:
            torch.save({"train": _stored(train), "held_out": None if held_out is None else _stored(held_out)},
                       staging / "data.pt")
            write_json(staging / "key.json", key)  # what the entry was made from, for a curious user
            os.replace(staging, entry)
        except OSError as e:
            raise ConfigError(f"the tokenize cache cannot be written in {entry.parent} ({e.strerror or e}); free "
                              f"space there, set data.cache_dir to another directory, or data.cache=false") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _stored(dataset: TokenDataset) -> dict:
    """Every row field by name (`relaytrain.schema.row.FIELDS`), integers at half the width
    (token ids and -100 fit int32), the facts and the records (plain values: weights_only loads them)."""
    tensors = {f.name: None if (t := getattr(dataset, f.name)) is None else t.to(_stored_dtype(f))
               for f in FIELDS}
    return {**tensors, "facts": dataset.facts, "rows_per_item": dataset.rows_per_item, "records": dataset.records}


def _stored_dtype(f: Field) -> torch.dtype:
    return torch.int32 if f.dtype == torch.long else f.dtype


def _cached(entry: Path) -> tuple[TokenDataset, TokenDataset | None] | None:
    """The entry's sets, or None when there is none, or none readable: a file cut short (a full
    disk, a copy interrupted) or damaged is said in one line and then prepared again, as a miss."""
    if not (entry / "data.pt").is_file():
        return None
    try:
        return _read_entry(entry)
    except Exception as e:  # noqa: BLE001 - whatever torch.load or the layout raises, the entry is only a copy
        print(f"relaytrain: the cached tokenized set at {entry} was unreadable ({_reason(e)}); tokenizing again",
              file=sys.stderr, flush=True)
        return None


def _reason(e: Exception) -> str:
    """The error's type and first sentence: torch's unpickling errors go on about weights_only,
    which is no advice for a damaged file."""
    sentence = first_line(e).split(". ")[0]
    return f"{type(e).__name__}: {sentence[:120]}" if sentence != type(e).__name__ else sentence


def _read_entry(entry: Path) -> tuple[TokenDataset, TokenDataset | None]:
    stored = torch.load(entry / "data.pt", weights_only=True)
    return _dataset(stored["train"]), None if stored["held_out"] is None else _dataset(stored["held_out"])


def _dataset(stored: dict) -> TokenDataset:
    """The stored set; an optional field the entry lacks (one written before the field was
    defined, when no set had it) is None."""
    def tensor(f: Field) -> torch.Tensor | None:
        t = stored.get(f.name) if f.optional else stored[f.name]
        return None if t is None else t.to(f.dtype)

    return TokenDataset(**{f.name: tensor(f) for f in FIELDS}, facts=stored["facts"],
                        rows_per_item=stored.get("rows_per_item", 1), records=stored.get("records"))
