"""Files a reader never sees half of: written under a temporary name beside their place, flushed
to disk, then renamed over it. Checkpoints, results.json, status.json, plan.json and a failed
worker's error record are all written this way, so a run killed at any point leaves each of
them whole or as it was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(final: Path, write: Callable[[IO[bytes]], object]) -> None:
    """`write(f)` into a temporary file, then make it `final` in one rename (durably)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_json(path: Path, record, indent: int | None = 1) -> Path:
    """`record` as JSON at `path`, atomically; values JSON lacks (enums, paths) as their text."""
    text = json.dumps(record, indent=indent, default=str) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
    return Path(path)


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
