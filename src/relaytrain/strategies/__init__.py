"""Execution strategies: where the weights live and in what order work runs.

Each strategy is a class registered by name (`@register("l2l")`) in a module of this package;
`strategy_class(name)` finds it. Modules are discovered, not listed: a new strategy is a new
module (plus its config file and tests), and nothing here changes. Registering checks that
the class answers the whole contract and names a cost model that answers the planner's
questions (`cost.model.CostModel`), so a strategy without one fails at import instead of
being left out of `relaytrain plan`.

A *preset* is a strategy with some of its keys fixed, made by a config file alone:
`configs/strategy/l2l_stash_cpu.yaml` is `l2l` with `stash: host`. It runs the class it names
in its defaults (`l2l_schema`), keeps its own name for the user (results.json, the report),
and refuses an override of a key it fixes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib import resources

import torch
import yaml

from relaytrain.cost.model import CostModel
from relaytrain.placement.world import World
from relaytrain.strategies.base import Capabilities, StepResult, Strategy
from relaytrain.utils.discovery import import_modules_of
from relaytrain.utils.errors import ConfigError

__all__ = ["Capabilities", "Preset", "StepResult", "Strategy", "build_strategy", "check_preset", "choices", "presets",
           "register", "registry", "strategy_class"]

SCHEMA_SUFFIX = "_schema"  # a strategy's typed config group in Hydra's ConfigStore: <name>_schema

_REGISTRY: dict[str, type[Strategy]] = {}


def register(name: str):
    """Class decorator: make a Strategy subclass available as `strategy=<name>`."""

    def add(cls: type[Strategy]) -> type[Strategy]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"strategy {name!r} is registered twice ({_REGISTRY[name].__qualname__}, {cls.__qualname__})")
        unanswered = sorted(getattr(cls, "__abstractmethods__", ()))
        if unanswered:
            raise TypeError(f"strategy {name!r} ({cls.__qualname__}) does not answer {', '.join(unanswered)} of the "
                            f"contract in strategies/base.py")
        _check_cost_model(name, cls)
        schedule = getattr(cls, "schedule", None)  # a pipeline's program is named as the strategy that runs it
        if schedule is not None and schedule.name != name:
            raise TypeError(f"strategy {name!r} ({cls.__qualname__}) runs schedule {schedule.__qualname__}, "
                            f"named {schedule.name!r}; a schedule's name is its strategy's")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def _check_cost_model(name: str, cls: type[Strategy]) -> None:
    """A strategy names a cost model that answers the planner (bound to it by `Strategy`)."""
    model = getattr(cls, "cost_model", None)
    if isinstance(model, CostModel) and model.strategy is cls:
        return
    if isinstance(model, type) and issubclass(model, CostModel):
        raise TypeError(f"strategy {name!r} ({cls.__qualname__}): its cost model {model.__qualname__} does not answer "
                        f"{', '.join(sorted(model.__abstractmethods__))} (the planner needs every strategy's cost and memory)")
    raise TypeError(f"strategy {name!r} ({cls.__qualname__}) names no cost model: set cost_model to a "
                    f"cost.model.CostModel subclass (the planner needs every strategy's cost and memory)")


def registry() -> dict[str, type[Strategy]]:
    """Every registered strategy by name (importing the package's modules the first time)."""
    import_modules_of(__name__)
    return dict(sorted(_REGISTRY.items()))


@dataclass(frozen=True)
class Preset:
    """A config file that runs a registered strategy with some keys fixed."""

    name: str
    strategy: str  # the registered strategy it runs
    fixed: dict  # strategy key -> the value the preset sets


def presets() -> dict[str, Preset]:
    """Every preset in the packaged config files: a strategy option that is not a registered name."""
    classes = registry()
    found = {}
    for path in (resources.files("relaytrain.configs") / "strategy").iterdir():
        name = path.name.removesuffix(".yaml")
        if not path.name.endswith(".yaml") or name in classes:
            continue
        content = yaml.safe_load(path.read_text()) or {}
        schema = next((d for d in content.get("defaults", []) if str(d).endswith(SCHEMA_SUFFIX)), None)
        if schema is None or schema.removesuffix(SCHEMA_SUFFIX) not in classes:
            raise ValueError(f"configs/strategy/{path.name} names no registered strategy's schema in its defaults")
        fixed = {k: v for k, v in content.items() if k not in ("defaults", "name")}
        found[name] = Preset(name, schema.removesuffix(SCHEMA_SUFFIX), fixed)
    return dict(sorted(found.items()))


def choices() -> list[str]:
    """Every `strategy=` option: the registered strategies and the presets."""
    return sorted([*registry(), *presets()])


def strategy_class(name) -> type[Strategy]:
    """The class that runs `strategy=name` (a preset runs its strategy's)."""
    known = registry()
    name = str(name)
    if name in known:
        return known[name]
    preset = presets().get(name)
    if preset is not None:
        return known[preset.strategy]
    hint = difflib.get_close_matches(name, choices(), n=1)
    fix = f"did you mean strategy={hint[0]}? " if hint else ""
    raise ConfigError(f"strategy={name} is not a known strategy; {fix}choose one of: {', '.join(choices())}")


def check_preset(s) -> None:
    """A preset's fixed strategy keys (`s`) keep their values (one line naming the strategy that has the key)."""
    preset = presets().get(str(s.name))
    if preset is None:
        return
    for key, value in preset.fixed.items():
        if str(s[key]) != str(value):
            raise ConfigError(f"strategy.{key} is not a key of strategy={preset.name}; only strategy={preset.strategy} "
                              f"has it (see relaytrain train --help)")


def build_strategy(model, cfg, device: str | torch.device = "cpu") -> Strategy:
    """A one-process strategy, here in this process, on `device` (for tests, benchmarks and
    notebooks); `relaytrain.run.train.run` is the way to run any strategy, several processes included."""
    cls = strategy_class(cfg.strategy.name)
    if cls.processes(cfg) != 1:
        raise ConfigError(f"strategy={cfg.strategy.name} runs {cls.processes(cfg)} processes; "
                          f"run it with relaytrain.run.train.run")
    return cls(model, cfg, World(device=torch.device(device)))
