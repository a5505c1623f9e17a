"""Files a reader never sees half of: written under a temporary name beside their place, flushed
to disk, then renamed over it. Checkpoints, results.json, status.json, plan.json and a failed
worker's error record are all written this way, so a run killed at any point leaves each of
them whole or as it was.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(final: Path, write: Callable[[IO[bytes]], object]) -> int:
    """`write(f)` into a temporary file, then make it `final` in one rename (durably). Returns
    the CRC-32 of what was written. A write that fails (a full disk) leaves no temporary file."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    summed = None
    try:
        with open(tmp, "wb") as f:
            summed = _Checksummed(f)
            write(summed)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if summed is not None and summed.error is not None and summed.error is not err:
            raise summed.error from err  # torch.save reports a failed write as a RuntimeError
        raise
    fsync_dir(final.parent)
    return summed.crc


def crc32_of(path: Path, chunk: int = 1 << 24) -> int:
    """The CRC-32 of a file's bytes, as `atomic_write` returns it."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


class _Checksummed:
    """A binary file that keeps the CRC-32 of what passes through it (4 GB/s: cheaper than a re-read)."""

    def __init__(self, file: IO[bytes]):
        self.file, self.crc = file, 0
        self.error: OSError | None = None  # the OS's own error, whatever a writer makes of it

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


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
