"""Registries fill themselves: a registry's package imports its modules once, the first time
it is asked, and each module registers what it defines (strategies, data sources, objectives)."""

from __future__ import annotations

import importlib
import pkgutil

_IMPORTED: set[str] = set()


def import_modules_of(package: str) -> None:
    """Import every module below `package` once (a module that fails to import is tried again
    at the next call)."""
    if package in _IMPORTED:
        return
    _IMPORTED.add(package)  # before the loop: a module that asks its registry while importing gets no loop of its own
    try:
        path = importlib.import_module(package).__path__
        for module in pkgutil.walk_packages(path, prefix=f"{package}."):
            importlib.import_module(module.name)
    except BaseException:
        _IMPORTED.discard(package)
        raise
