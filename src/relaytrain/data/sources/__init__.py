"""Data sources: where a run's samples come from (`data=<name>`, the key data.source).

Each source is a class registered by name (`@register_source("jsonl")`) in a module of this
package; `source(name)` finds it. Modules are discovered, not listed: a new source is a new
module (plus its config file and tests), and nothing here changes. A source answers two
questions: `check(cfg, objective)`, its rules for the data keys (which it needs, which it
refuses) for the run's objective, run with every config check before any work; and `load(cfg, tokenizer_dir, objective, family)`, the
training set and the held-out set it names itself, for the run's objective and model family
(resolved once: `relaytrain.run.resolve`).

Most rules follow from where a source's samples come from (`Origin`): a record source needs
data.path (or a mixture, data.mix) and may name held-out records (data.eval_path); a Hugging Face
dataset may name a local copy (data.path) and a held-out split (data.eval_split); only a source
that `packs` takes data.pack. So the messages name the sources that do take a key, read off the
registry. What a source reads (`inputs`) is also what the tokenize cache fingerprints
(`data/cache.py`).
"""

from __future__ import annotations

import abc
import difflib
from enum import Enum
from typing import TYPE_CHECKING

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.mixture import check_mix
from relaytrain.data.reading import Input, check_location, locate
from relaytrain.data.stream import check_streaming
from relaytrain.data.tokenizer import tokenizer_location
from relaytrain.utils.discovery import import_modules_of
from relaytrain.utils.errors import ConfigError

if TYPE_CHECKING:
    from relaytrain.models.family import Family
    from relaytrain.objectives.base import Objective

__all__ = ["DataSource", "Origin", "held_out_options", "register_source", "source", "source_names", "sources"]


class Origin(Enum):
    """Where a source's samples come from, which decides most of its rules."""

    generated = "generated"  # made here from data.seed: no file, no network
    file = "file"  # records at data.path, in any form reading.py takes (or data.mix); held out: data.eval_path
    hub = "hub"  # a Hugging Face dataset, or its local copy (data.path); held out: its own split (data.eval_split)


class DataSource(abc.ABC):
    """One kind of data. Class level only: a source is asked, never instantiated."""

    name: str  # set by register_source
    origin: Origin
    packs: bool = False  # data.pack: short records packed into rows of data.seq_len
    chat_template: bool = False  # renders records with the tokenizer's chat template (which tokenizer it picks)
    streams: bool = False  # data.streaming: it answers `stream(cfg, tokenizer_dir, objective, family)` (data/stream.py)
    gives_pairs: bool = False  # items of two rows, for an objective that compares them (`Objective.rows_per_item`)
    # Prompts alone, a row each: for an objective that learns online (`Objective.learns_online`), whose
    # rollout stage samples the completions and reads the prompt as written from `TokenDataset.records`.
    gives_prompts: bool = False

    @classmethod
    @abc.abstractmethod
    def load(cls, cfg, tokenizer_dir: str | None, objective: Objective, family: Family
             ) -> tuple[TokenDataset, TokenDataset | None]:
        """The training set cfg.data describes, tokenized for cfg.model, and the held-out set the
        source itself names (None without one). `tokenizer_dir`: where a tokenizer used for text is
        saved (`<tokenizer_dir>/tokenizer`), so that a saved model ships with it. `objective`,
        `family`: the run's (what its labels are, which tokenizer a run trains, whether packed
        records stay apart)."""

    @classmethod
    def check(cls, cfg, objective: Objective) -> None:
        """Its rules for cfg.data, for the run's `objective` (ConfigError, one line); a source with
        more extends it."""
        d = cfg.data
        if d.streaming:
            if not cls.streams:
                streaming = [name for name, s in sources().items() if s.streams]
                raise ConfigError(f"data.streaming=true streams data={' or '.join(streaming)} records; data={cls.name} "
                                  f"reads its whole set (tokenized once, then cached): drop data.streaming")
            check_streaming(mixes=bool(d.mix), eval_fraction=d.eval_fraction, shuffle_buffer=d.shuffle_buffer,
                            objective=objective, tokenizer=tokenizer_location(cfg.model.pretrained, d.tokenizer))
        cls._check_path(d)
        cls._check_pack(cfg.data)
        cls._check_held_out(cfg.data)

    @classmethod
    def inputs(cls, cfg) -> list[Input]:
        """What it reads: the content the tokenize cache fingerprints. Generated data reads
        nothing, so it is never cached."""
        d = cfg.data
        if cls.origin is Origin.generated:
            return []
        if cls.origin is Origin.hub:
            splits = [split for split in (d.split, d.eval_split) if split]
            if d.path:
                return [Input(d.path, "data.path", split, d.name) for split in splits]
            return [Input(cls.hub_dataset, "data.name", split, d.name, hub=True) for split in splits]
        parts = [Input(p.path, f"data.mix[{i}].path", p.split, p.name) for i, p in enumerate(d.mix)]
        held_out = [Input(d.eval_path, "data.eval_path", d.split, d.name)] if d.eval_path else []
        held_out += [Input(d.path, "data.path", d.eval_split, d.name)] if d.eval_split else []
        return (parts or [Input(d.path, "data.path", d.split, d.name)]) + held_out

    @classmethod
    def benchmark_task(cls, name: str | None) -> str | None:
        """The benchmark task whose own metric evaluation reports beside loss and accuracy
        (`evaluation.metric_names`) for the dataset `data.name` names; None for data that is
        no benchmark."""
        return None

    @classmethod
    def _check_path(cls, d) -> None:
        if d.mix and cls.origin is not Origin.file:
            raise ConfigError(f"data.mix mixes record sets for data={' or '.join(source_names(Origin.file))}; "
                              f"data={cls.name} reads one dataset: drop data.mix")
        if cls.origin is Origin.file and d.mix:
            check_mix(d.path, [part.weight for part in d.mix])
            for i, part in enumerate(d.mix):
                check_location(part.path, f"data.mix[{i}].path")
        elif cls.origin is Origin.file:
            if not d.path:
                raise ConfigError(f"data={cls.name} needs a file or dataset of records: set data.path=/path/to/train.jsonl "
                                  f"(or a parquet, arrow or csv file, a glob, a `datasets` directory, a hub id), or "
                                  f"data.mix")
            check_location(d.path, "data.path")
        if cls.origin is Origin.hub and d.path:
            check_location(d.path, "data.path")

    @classmethod
    def _check_pack(cls, d) -> None:
        if d.pack and not cls.packs:
            packing = [name for name, s in sources().items() if s.packs]
            raise ConfigError(f"data.pack=true packs {' or '.join(packing)} records into rows; data={cls.name} has "
                              f"none: drop data.pack or use {' or '.join(f'data={name}' for name in packing)}")

    @classmethod
    def _check_held_out(cls, d) -> None:
        if d.eval_path and cls.origin is not Origin.file:
            instead = "data.eval_split (e.g. validation) or " if cls.origin is Origin.hub else ""
            raise ConfigError(f"data.eval_path is a jsonl file for data={' or '.join(source_names(Origin.file))} (or "
                              f"any form data.path takes); for data={cls.name} use {instead}data.eval_fraction")
        if d.eval_path:
            check_location(d.eval_path, "data.eval_path", "/path/to/eval.jsonl")
        if d.eval_split and cls.origin is Origin.generated:
            raise ConfigError(f"data.eval_split names a split of a hub dataset or `datasets` directory; "
                              f"data={cls.name} has none: use data.eval_fraction")
        if d.eval_split and cls.origin is Origin.file and (d.mix or locate(d.path, "data.path").kind == "files"):
            raise ConfigError(f"data.eval_split picks a split of a `datasets` directory or hub dataset, and "
                              f"{'data.mix' if d.mix else f'data.path={d.path}'} is files; use data.eval_path or "
                              f"data.eval_fraction")


_REGISTRY: dict[str, type[DataSource]] = {}


def register_source(name: str):
    """Class decorator: make a DataSource subclass available as `data=<name>`."""

    def add(cls: type[DataSource]) -> type[DataSource]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"data source {name!r} is registered twice ({_REGISTRY[name].__qualname__}, "
                             f"{cls.__qualname__})")
        unanswered = sorted(getattr(cls, "__abstractmethods__", ()))
        if unanswered or not isinstance(getattr(cls, "origin", None), Origin):
            raise TypeError(f"data source {name!r} ({cls.__qualname__}) must say its origin and answer "
                            f"{', '.join(unanswered) or 'load'} (data/sources/__init__.py)")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def sources() -> dict[str, type[DataSource]]:
    """Every registered source by name (importing the package's modules the first time)."""
    import_modules_of(__name__)
    return dict(sorted(_REGISTRY.items()))


def source_names(origin: Origin | None = None) -> list[str]:
    """The registered names (of the sources with `origin`, when given), sorted."""
    return [name for name, s in sources().items() if origin is None or s.origin is origin]


def source(name) -> type[DataSource]:
    """The source `data.source=name` reads; one line naming those there are when there is none."""
    known = sources()
    name = str(name)
    if name in known:
        return known[name]
    hint = difflib.get_close_matches(name, list(known), n=1)
    fix = f"did you mean data={hint[0]}? " if hint else ""
    raise ConfigError(f"data.source={name} is not a data source; {fix}choose one of: {', '.join(known)}")


def held_out_options() -> str:
    """The keys that give held-out data, and the sources that take each (for messages)."""
    return (f"data.eval_fraction (e.g. 0.1), data.eval_path ({', '.join(source_names(Origin.file))}) or "
            f"data.eval_split ({', '.join(source_names(Origin.hub))})")
