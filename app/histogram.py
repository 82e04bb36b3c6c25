"""A cumulative-bucket histogram that takes bulk observations: the publisher's and the consumer
kit's latency figures, exported through their own prometheus collectors. Pure: standard library
only (a ``multiple`` ack that settles 500 rows published in one write is one call, and the count
is still the number of rows)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


class Histogram:
    """Cumulative-bucket histogram with bulk observations (no lock: one event loop)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, +Inf last (not cumulative)
        self.sum = 0.0
        self.count = 0

    def observe_many(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    observe = observe_many

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            out.append(("+Inf" if math.isinf(bound) else repr(bound), running))
        return out

    def quantile(self, q: float, *, since: Sequence[int] | None = None) -> float | None:
        """Upper bound of the bucket holding quantile ``q`` (None without observations);
        ``since``: of the observations after that copy of :attr:`counts` only."""
        counts = self.counts
        if since is not None:
            counts = [a - b for a, b in zip(self.counts, since, strict=True)]
        total = sum(counts)
        if not total:
            return None
        rank, running = q * total, 0
        for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
            running += count
            if running >= rank:
                return bound if not math.isinf(bound) else self.bounds[-1]
        return self.bounds[-1]
