"""Execution strategies: where the weights live and in what order work runs.

Each strategy is a class registered by name (`@register("l2l")`) in a module of this package;
`strategy_class(name)` finds it. Modules are discovered, not listed: a new strategy is a new
module (plus its config file and tests), and nothing here changes.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil

import torch

from relaytrain.errors import ConfigError
from relaytrain.strategies.base import Capabilities, StepResult, Strategy

__all__ = ["Capabilities", "StepResult", "Strategy", "build_strategy", "register", "registry", "strategy_class"]

_REGISTRY: dict[str, type[Strategy]] = {}
_discovered = False


def register(name: str):
    """Class decorator: make a Strategy subclass available as `strategy=<name>`."""

    def add(cls: type[Strategy]) -> type[Strategy]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"strategy {name!r} is registered twice ({_REGISTRY[name].__qualname__}, {cls.__qualname__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def registry() -> dict[str, type[Strategy]]:
    """Every registered strategy by name (importing the package's modules the first time)."""
    global _discovered
    if not _discovered:
        for module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
            importlib.import_module(module.name)
        _discovered = True
    return dict(sorted(_REGISTRY.items()))


def strategy_class(name) -> type[Strategy]:
    known = registry()
    name = str(name)
    if name not in known:
        hint = difflib.get_close_matches(name, known, n=1)
        fix = f"did you mean strategy={hint[0]}? " if hint else ""
        raise ConfigError(f"strategy={name} is not a known strategy; {fix}choose one of: {', '.join(known)}")
    return known[name]


def build_strategy(model, cfg, device: str | torch.device = "cpu") -> Strategy:
    """A one-process strategy, here in this process, on `device` (for tests, benchmarks and
    notebooks); `relaytrain.train.run` is the way to run any strategy, several processes included."""
    from relaytrain.world import World

    cls = strategy_class(cfg.strategy.name)
    if cls.processes(cfg) != 1:
        raise ConfigError(f"strategy={cfg.strategy.name} runs {cls.processes(cfg)} processes; "
                          f"run it with relaytrain.train.run")
    return cls(model, cfg, World(device=torch.device(device)))
