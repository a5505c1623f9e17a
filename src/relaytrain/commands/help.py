"""`relaytrain train --help`: every config group and every key, with its value and what it does.

The descriptions are the typed schema's own field comments (`config.field_docs`), and the
keys are those of the config the given overrides compose, so the help shows exactly the keys
the chosen strategy and optimizer accept, and cannot drift from the schema.
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
from enum import Enum
from importlib import resources

from omegaconf import OmegaConf

from relaytrain.schema.config import RelayTrainConfig, field_docs
from relaytrain.step.optim import optimizer_schemas

HEADER = """\
relaytrain train: train a layered transformer with one of relaytrain's strategies.

Usage: relaytrain train [GROUP=OPTION ...] [KEY=VALUE ...] [+exp=NAME] [-m]
  GROUP=OPTION   pick a config group's option (model=bert_base, strategy=l2l)
  KEY=VALUE      set a key (optim.lr=3e-4)
  +exp=NAME      load a packaged experiment from configs/exp/ (it only overrides)
  -m             multirun: sweep comma-separated values (strategy=baseline,l2l); ends with one table
  hydra.run.dir  where results.json, metrics.csv, checkpoints/ and model/ go
  `relaytrain train strategy=l2l --help` shows the keys of that choice; --hydra-help shows Hydra's flags.
"""


def train_help(overrides: list[str], compose) -> str:
    cfg = compose(overrides, return_hydra_config=True)
    width = shutil.get_terminal_size((110, 24)).columns
    lines = [HEADER, "Config groups (GROUP=OPTION; * marks this config's choice):"]
    lines += _group_lines(cfg.hydra.runtime.choices, width)
    lines += ["", "Keys of this config (KEY=VALUE) and what they do:"]
    for section, schema in _sections(cfg):
        docs = field_docs(schema)
        for f in dataclasses.fields(schema):
            lines.extend(_key_lines(f"{section}.{f.name}", cfg[section][f.name], docs.get(f.name, ""), f.type, width))
    return "\n".join(lines) + "\n"


def _group_lines(choices, width: int) -> list[str]:
    """Each group's options, wrapped to the terminal, the chosen one starred. `choices` is Hydra's
    record of each group's option: adapter=qlora is starred, though its adapter.name is lora."""
    lines = []
    for group in (*option_groups(), "exp"):
        options = [("*" if name == choices.get(group) else "") + name for name in _options(group)]
        head = f"  {group:<10} {'+exp=NAME: ' if group == 'exp' else ''}"
        lines += textwrap.wrap(" ".join(options), max(width, 60), initial_indent=head,
                               subsequent_indent=" " * 13, break_on_hyphens=False)
    lines.append(f"  {', '.join(key_sections())}: no options, keys only (below)")
    return lines


def option_groups() -> list[str]:
    """The config sections picked by GROUP=OPTION: those with a folder of options in configs/."""
    configs = resources.files("relaytrain.configs")
    return [f.name for f in dataclasses.fields(RelayTrainConfig) if configs.joinpath(f.name).is_dir()]


def key_sections() -> list[str]:
    """The config sections set key by key only (train.steps=50): no folder of options."""
    groups = option_groups()
    return [f.name for f in dataclasses.fields(RelayTrainConfig) if f.name not in groups]


def _options(group: str) -> list[str]:
    folder = resources.files("relaytrain.configs") / group
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _sections(cfg):
    """(section, schema) for every section of the config, the chosen strategy's and optimizer's own."""
    from relaytrain.strategies import strategy_class

    for f in dataclasses.fields(RelayTrainConfig):
        if f.name == "strategy":
            yield f.name, strategy_class(cfg.strategy.name).Config
        elif f.name == "optim":
            yield f.name, optimizer_schemas()[str(cfg.optim.name)]
        else:
            yield f.name, f.default_factory


def _key_lines(key: str, value, doc: str, annotation, width: int) -> list[str]:
    shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    shown = "null" if shown is None else str(shown.value if isinstance(shown, Enum) else shown)
    enum_type = next((t for t in _types(annotation) if isinstance(t, type) and issubclass(t, Enum)), None)
    if enum_type is not None:
        doc += f" [{'|'.join(m.value for m in enum_type)}]"
    head = f"  {key} = {shown}"
    column = 44
    text = textwrap.wrap(doc, max(width - column - 2, 30)) or [""]
    if len(head) >= column:
        return [head, *(" " * column + t for t in text)]
    return [head.ljust(column) + text[0], *(" " * column + t for t in text[1:])]


def _types(annotation) -> list:
    if isinstance(annotation, str):  # `from __future__ import annotations`: resolve by name
        from relaytrain.schema import config

        names = [part.strip() for part in annotation.split("|")]
        return [getattr(config, n, None) or _option_enum(n) for n in names]
    return [annotation]


def _option_enum(name: str):
    """An enum that a strategy's or an optimizer's own module declares (`strategy.*`, `optim.*` keys)."""
    from relaytrain.strategies import registry

    for owner in [*registry().values(), *optimizer_schemas().values()]:
        module = __import__(owner.__module__, fromlist=[name])
        if hasattr(module, name):
            return getattr(module, name)
    return None
