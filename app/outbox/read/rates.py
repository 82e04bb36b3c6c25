"""The console overview's rates: rows written, confirmed and failed per minute and each
minute's confirm latency, from the publishers' samples (``outbox_samples``); the chart is drawn
by the pure :mod:`app.rates`.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, select

from app.outbox.read.figures import weighted_median
from app.outbox.schema import samples

RATE_WINDOW = dt.timedelta(hours=1)
#: Samples this long before the window are read too: each publisher's last one before it is
#: the baseline of its first difference (the longest sample interval is an hour).
SAMPLE_BASELINE = dt.timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Rates:
    """Rows per minute over a window ending at ``end``, from the publishers' samples
    (``outbox_samples``): written (the rise of the outbox's highest id), confirmed and failed
    (a return, a final nack or a failure) as the differences of each publisher's counters
    between consecutive samples, and the confirm latency of each minute (p50: the samples'
    median weighted by their confirms; p99: the highest). Index ``i`` of each list is the minute
    ``(start + i min, start + (i + 1) min]``; a difference counts in its later sample's minute.
    ``sampled``: some publisher recorded figures in the window (without, the rates are blind).
    Cost: the samples of the window and its baseline (one per publisher and sample interval),
    whatever the traffic."""

    start: dt.datetime
    end: dt.datetime
    written: list[int]
    confirmed: list[int]
    failed: list[int]
    latency_p50_ms: list[float | None]
    latency_p99_ms: list[float | None]
    sampled: bool


def rates(engine: Engine, *, now: dt.datetime, window: dt.timedelta = RATE_WINDOW) -> Rates:
    minutes = max(1, int(window.total_seconds() // 60))
    start = now - dt.timedelta(minutes=minutes)
    stmt = (
        select(samples)
        .where(samples.c.at >= start - SAMPLE_BASELINE, samples.c.at <= now)
        .order_by(samples.c.at, samples.c.publisher_id)
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    written, confirmed, failed = [0] * minutes, [0] * minutes, [0] * minutes
    p50s: list[list[tuple[float, int]]] = [[] for _ in range(minutes)]
    p99: list[float | None] = [None] * minutes

    def minute(at: dt.datetime) -> int | None:
        """The minute a sample closes: the one that ends at or after it (a sample at the
        window's end closes its last minute)."""
        i = math.ceil((at - start).total_seconds() / 60) - 1
        return i if 0 <= i < minutes else None

    last: dict[str, Any] = {}
    top: int | None = None
    sampled = False
    for row in rows:
        i = minute(row.at)
        sampled = sampled or i is not None
        before = last.get(row.publisher_id)
        last[row.publisher_id] = row
        if row.max_id is not None:
            if i is not None and top is not None and row.max_id > top:
                written[i] += row.max_id - top
            top = row.max_id if top is None else max(top, row.max_id)
        if i is None or before is None:
            continue
        done = max(0, row.confirmed - before.confirmed)
        confirmed[i] += done
        failed[i] += max(0, row.failed - before.failed)
        if row.latency_p50_ms is not None:
            p50s[i].append((row.latency_p50_ms, max(1, done)))
        if row.latency_p99_ms is not None:
            p99[i] = max(p99[i] or 0.0, row.latency_p99_ms)
    return Rates(
        start=start,
        end=now,
        written=written,
        confirmed=confirmed,
        failed=failed,
        latency_p50_ms=[weighted_median(m) for m in p50s],
        latency_p99_ms=p99,
        sampled=sampled,
    )
