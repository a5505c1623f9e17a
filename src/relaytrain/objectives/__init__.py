"""Objectives: what the head's output is trained to do, registered by name and asked, never
branched on.

An objective turns the head's logits and the micro-batch into the micro-batch's loss (a sum,
`base.LossTerms`), counts the items that sum is over, and makes the evaluation sums; it also
answers the questions the rest of the program has about it (`Objective.classifies`,
`predicts_next_token`, `masks_tokens`, its `metric`, its Hugging Face head). `model.task` names
one: a registered name, or `package.module:Class` for one defined outside relaytrain (a test's),
which `objective` imports, so a spawned worker finds it as the process that registered it did.

This module imports nothing heavy (the config imports it); the objectives themselves live in the
package's other modules, imported the first time one is looked up (as the strategies are).
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING

from relaytrain.utils.discovery import import_modules_of
from relaytrain.utils.errors import ConfigError, first_line

if TYPE_CHECKING:
    from relaytrain.objectives.base import Objective

DEFAULT = "classification"  # model.task when a config names none

_OBJECTIVES: dict[str, Objective] = {}


def origin(cls: type) -> str:
    """The import path of a class: `package.module:Class`."""
    return f"{cls.__module__}:{cls.__qualname__}"


def register_objective(cls: type) -> type:
    """Class decorator: one instance of `cls` under its `name`, or, for a class that names none
    (one of a user's, a test's), under its import path, which becomes its name."""
    name = cls.__dict__.get("name") or origin(cls)
    held = _OBJECTIVES.get(name)
    if held is not None and origin(type(held)) != origin(cls):  # the same module run again replaces itself
        raise ValueError(f"objective {name!r} is registered twice")
    cls.name = name
    _OBJECTIVES[name] = cls()
    return cls


def objectives() -> dict[str, Objective]:
    """Every registered objective by name."""
    import_modules_of(__name__)
    return dict(_OBJECTIVES)


def objective(name, key: str = "model.task") -> Objective:
    """The objective `name` names (an import path is imported first), or one line naming those
    there are; `key`: the config key that gave the name (model.task, or objective.name)."""
    import_modules_of(__name__)
    name = str(name)
    if name not in _OBJECTIVES and ":" in name:
        _import(name)
    if name in _OBJECTIVES:
        return _OBJECTIVES[name]
    named = [known for known in _OBJECTIVES if ":" not in known]  # those registered under an import path say so
    hint = difflib.get_close_matches(name, named, n=1)
    fix = f"did you mean {key}={hint[0]}? " if hint else ""
    raise ConfigError(f"{key}={name} is not one of {', '.join(named)}; {fix}(or give an objective of your own "
                      f"as package.module:Class)")


def objective_of_architecture(architecture: str) -> Objective | None:
    """The objective whose head a checkpoint's architecture has (`...ForCausalLM`), or None: the
    one that declares those endings itself, not an objective that inherits them."""
    for spec in objectives().values():
        if architecture.endswith(type(spec).__dict__.get("architectures", ())):
            return spec
    return None


def _import(path: str) -> None:
    """Import `package.module:Class`; the class is registered under that path (its module's own
    `register_objective` may have done so already)."""
    module, _, attribute = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model.task={path}: cannot import that objective ({first_line(err)}); give "
                          f"package.module:Class, importable here and in every worker") from err
    if path not in _OBJECTIVES:
        if not any(type(spec) is cls for spec in _OBJECTIVES.values()):
            register_objective(cls)
        _OBJECTIVES.setdefault(path, next(spec for spec in _OBJECTIVES.values() if type(spec) is cls))


