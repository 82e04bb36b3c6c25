"""Pure figures of the read side (standard library only): ages, percentiles and weighted
medians, computed in Python so both backends give the same answer.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence


def age_seconds(since: dt.datetime | None, now: dt.datetime) -> float | None:
    """Seconds from ``since`` to ``now``, never negative (clocks of other hosts may run ahead)."""
    if since is None:
        return None
    return max(0.0, (now - since).total_seconds())


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of an ascending sequence; None when empty."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def weighted_median(values: list[tuple[float, int]]) -> float | None:
    """The median of ``(value, weight)`` pairs, each value counted ``weight`` times; None when
    empty."""
    if not values:
        return None
    ordered = sorted(values)
    half, running = sum(w for _, w in ordered) / 2, 0
    for value, weight in ordered:
        running += weight
        if running >= half:
            return value
    return ordered[-1][0]  # pragma: no cover (the loop reaches half)
