"""Figures as people read them: durations, SI prefixes, binary sizes."""

from __future__ import annotations

GiB = 2**30  # bytes in a GiB, every size the planner and the rollouts report


def duration(seconds: float) -> str:
    """A human duration: 0.3 s, 12 s, 4 min, 2.5 h, 3.1 days."""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def si(value: float | None, unit: str = "") -> str:
    """1.23 M, 4.56 GFLOP/s; n/a for a figure that does not exist."""
    if value is None:
        return "n/a"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}".rstrip()


def gib(value: int | None) -> str:
    """Bytes in GiB, or in MiB/KiB when a GiB figure would read 0.00."""
    if value is None:
        return "n/a"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value >= scale or unit == "KiB":
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"
