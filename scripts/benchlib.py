"""What every benchmark script reports for a comparison: the median of its rounds' ratios
(the headline: robust to one lucky or unlucky round), the best round and the spread."""

from __future__ import annotations

import statistics


def headline(per_round: list[float], target: float, lower_is_better: bool = False) -> dict:
    """`per_round`: the comparison's figure in each round (both contestants measured in it).

    `target`: met when the median is at least it, or, `lower_is_better`, below it.
    """
    best = min(per_round) if lower_is_better else max(per_round)
    median = statistics.median(per_round)
    return {
        "median": median,
        "best": best,
        "spread": [min(per_round), max(per_round)],
        "rounds": per_round,
        "target": target,
        "lower_is_better": lower_is_better,
        "met": median < target if lower_is_better else median >= target,
    }
