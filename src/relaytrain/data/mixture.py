"""A source's training records: data.path's, or a mixture of several record sets (data.mix).

A mixture draws as many records as its parts hold together, each part its weight's share
(largest remainders, so the counts add up), with a generator seeded by data.seed: a part drawn
less than it holds gives a random subset, one drawn more repeats itself whole and then a random
subset. The drawn records are then interleaved in a seeded order, so packed rows and the first
steps see every part. Which part gave how many is the mixture's `facts` (results.json's
`data.mix`). Each part is read on its own (`read`), so each may have its own shape and form.
A weight is positive and finite, and a part its weight would draw nothing of is refused: each a
line naming the part.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from relaytrain.utils.errors import ConfigError

# read(location, key, split, name) -> the checked records at that location
Read = Callable[[str, str, str, "str | None"], list]


def training_records(cfg, read: Read) -> tuple[list, list[dict] | None]:
    """The training records and, for a mixture, what each part gave (None without one)."""
    d = cfg.data
    if not d.mix:
        return read(d.path, "data.path", d.split, d.name), None
    weights = checked_weights([part.weight for part in d.mix])  # here too: a caller of the API may not have run the config checks
    parts = [read(part.path, f"data.mix[{i}].path", part.split, part.name) for i, part in enumerate(d.mix)]
    counts = shares(weights, sum(len(records) for records in parts))
    _check_every_part_drawn(d.mix, parts, counts)
    generator = torch.Generator().manual_seed(d.seed + 104_729)
    drawn = [item for records, count in zip(parts, counts, strict=True) for item in _draw(records, count, generator)]
    order = torch.randperm(len(drawn), generator=generator).tolist()
    facts = [{"path": part.path, "weight": float(part.weight), "records": len(records), "drawn": count}
             for part, records, count in zip(d.mix, parts, counts, strict=True)]
    return [drawn[i] for i in order], facts


def shares(weights: list[float], total: int) -> list[int]:
    """`total` split in proportion to `weights`, each positive and finite (largest remainders:
    the counts add up to it)."""
    largest = max(weights)  # scaled to at most 1 first, so that no sum of huge weights overflows
    scaled = [w / largest for w in weights]
    exact = [total * w / sum(scaled) for w in scaled]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _draw(records: list, count: int, generator: torch.Generator) -> list:
    whole, rest = divmod(count, len(records))
    subset = torch.randperm(len(records), generator=generator)[:rest].sort().values.tolist()
    return records * whole + [records[i] for i in subset]


def check_mix(path: str | None, weights: list) -> None:
    """data.mix's own rules, from data.path and the parts' weights (their locations are checked
    by the source)."""
    if path:
        raise ConfigError("data.path and data.mix both name the training records; keep data.mix (each part's "
                          "path and weight) or data.path")
    checked_weights(weights)


def checked_weights(weights: list) -> list[float]:
    """Each part's weight (as given), positive and finite: a negative or zero share of the drawn
    records has no meaning (and weights summing to zero would divide by it), nor has an infinite one."""
    for i, given in enumerate(weights):
        weight = float(given)
        if not (weight > 0 and math.isfinite(weight)):
            raise ConfigError(f"data.mix[{i}].weight={given} must be positive and finite (the part's share "
                              f"of the drawn records); give it such a weight, or drop the part")
    return [float(weight) for weight in weights]


def _check_every_part_drawn(mix, parts: list[list], counts: list[int]) -> None:
    """A part the user listed but its weight draws nothing of is a weight mistaken, not a wish."""
    total = sum(counts)
    for i, (part, records, count) in enumerate(zip(mix, parts, counts, strict=True)):
        if count == 0:
            raise ConfigError(f"data.mix[{i}].weight={part.weight} draws none of its {len(records)} records (of "
                              f"{total} drawn in all); raise its weight or drop the part")
