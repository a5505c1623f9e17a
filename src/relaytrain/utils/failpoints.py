"""Faults on demand at named points of a run: how the fault matrix (docs/faults.md) is made,
by its tests and by anyone who wants to see what a failure looks like before a cluster shows them.

`RELAYTRAIN_FAILPOINTS` lists faults, separated by `;`, each `POINT:STEP[:RANK]=ACTION`
(RANK left out: every process):

    step:5:1=hold          worker 1 stops before running step 5 and waits there
    evaluate:4:0=hold      worker 0 stops at the evaluation after step 4
    checkpoint:4:1=hold    worker 1 has written its part of step 4's checkpoint, which is not yet published
    checkpoint:4:1=enospc  worker 1's part of step 4's checkpoint fails to write, as on a full disk
    loss:5=nan             step 5's loss reads NaN

A held process first writes its pid to `RELAYTRAIN_FAILPOINT_MARKS/POINT-STEP-RANK` (that
directory must be given), so whoever kills or stops it knows it is there, whatever the
machine's speed. Steps count from 1, as the console does. Without the variable every point
is one lookup in an empty dict.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from pathlib import Path

from relaytrain.utils.errors import ConfigError

VARIABLE, MARKS = "RELAYTRAIN_FAILPOINTS", "RELAYTRAIN_FAILPOINT_MARKS"
POINTS = {"step": ("hold",), "evaluate": ("hold",), "checkpoint": ("hold", "enospc"), "loss": ("nan",)}


@functools.cache
def _parsed(text: str) -> dict:
    return parse(text)


def parse(text: str) -> dict[tuple[str, int, int | None], str]:
    """{(point, step, rank or None): action}; a malformed entry is one line naming it."""
    faults = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        where, _, action = entry.partition("=")
        fields = where.split(":")
        if len(fields) not in (2, 3) or fields[0] not in POINTS or action not in POINTS[fields[0]]:
            raise ConfigError(f"{VARIABLE}: cannot read {entry!r}; write POINT:STEP[:RANK]=ACTION with "
                              + ", ".join(f"{p} ({'/'.join(a)})" for p, a in POINTS.items()))
        try:
            step, rank = int(fields[1]), int(fields[2]) if len(fields) == 3 else None
        except ValueError:
            raise ConfigError(f"{VARIABLE}: {entry!r}: STEP and RANK are whole numbers") from None
        faults[fields[0], step, rank] = action
    return faults


def reach(point: str, step: int, rank: int) -> str | None:
    """Carry out the fault set for this point, step and process, if any: `hold` never returns,
    `enospc` raises the OSError a full disk raises; `nan` is returned for the caller to apply."""
    faults = _parsed(os.environ.get(VARIABLE, ""))
    action = faults.get((point, step, rank)) or faults.get((point, step, None))
    if action == "hold":
        _hold(f"{point}-{step}-{rank}")
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({VARIABLE})")
    return action


def _hold(name: str) -> None:
    marks = os.environ.get(MARKS)
    if not marks:
        raise ConfigError(f"{VARIABLE}: a hold needs {MARKS}, the directory its pid is written to")
    tmp = Path(marks, f".{name}.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, Path(marks, name))
    threading.Event().wait()
