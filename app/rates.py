"""The overview's rate chart and its trend in words: pure functions of the per-minute counts
(standard library only), so the numbers an operator reads are tested without a database.

The chart is an inline SVG the server draws (no script, nothing for the page's CSP to allow):
one polyline per series over a shared scale, a label per axis, and each series' latest
five-minute rate beside its name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: The trend reads the last few minutes: long enough to smooth a publisher's batches, short
#: enough to show a stall within minutes.
RECENT_MINUTES = 5
WIDTH, HEIGHT = 720, 180
LEFT, RIGHT, TOP, BOTTOM = 72, 8, 10, 22  # LEFT: room for "10,000 ms"


@dataclass(frozen=True, slots=True)
class Line:
    name: str
    points: str  # "x,y x,y ...": an SVG polyline's points
    per_minute: float  # over the last RECENT_MINUTES


@dataclass(frozen=True, slots=True)
class Chart:
    width: int
    height: int
    top: int
    bottom: int  # y of the time axis
    left: int
    right: int  # x of the last minute
    peak: int  # rows per minute at the top of the scale
    lines: list[Line]
    minutes: int


def recent_rate(counts: Sequence[int], minutes: int = RECENT_MINUTES) -> float:
    """Rows per minute over the last ``minutes`` of ``counts``."""
    tail = list(counts[-minutes:])
    return sum(tail) / len(tail) if tail else 0.0


def nice_peak(value: int) -> int:
    """The scale's top: ``value`` rounded up to 1, 2 or 5 times a power of ten (at least 1)."""
    if value <= 1:
        return 1
    power = int(10 ** math.floor(math.log10(value)))
    for step in (1, 2, 5, 10):
        if value <= step * power:
            return step * power
    return 10 * power  # pragma: no cover (the loop ends at 10 * power >= value)


def chart(series: Sequence[tuple[str, Sequence[int]]]) -> Chart:
    """Polylines of equally long per-minute series on one scale."""
    minutes = max((len(c) for _, c in series), default=0)
    peak = nice_peak(max((max(c, default=0) for _, c in series), default=0))
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP
    step = (x1 - x0) / max(1, minutes - 1)

    def points(counts: Sequence[int]) -> str:
        return " ".join(
            f"{x0 + i * step:.1f},{y0 - (y0 - y1) * c / peak:.1f}" for i, c in enumerate(counts)
        )

    lines = [Line(name, points(c), recent_rate(c)) for name, c in series]
    return Chart(WIDTH, HEIGHT, y1, y0, x0, x1, peak, lines, minutes)


def latency_chart(series: Sequence[tuple[str, Sequence[float | None]]]) -> Chart:
    """Polylines of per-minute latencies (ms) on one scale, through the minutes that have one
    (a minute without confirms has no latency); ``per_minute`` is the latest known value."""
    minutes = max((len(c) for _, c in series), default=0)
    known = [v for _, c in series for v in c if v is not None]
    peak = nice_peak(math.ceil(max(known, default=0)))
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP
    step = (x1 - x0) / max(1, minutes - 1)

    def points(values: Sequence[float | None]) -> str:
        return " ".join(
            f"{x0 + i * step:.1f},{y0 - (y0 - y1) * v / peak:.1f}"
            for i, v in enumerate(values)
            if v is not None
        )

    def latest(values: Sequence[float | None]) -> float:
        return next((v for v in reversed(values) if v is not None), 0.0)

    lines = [Line(name, points(c), latest(c)) for name, c in series]
    return Chart(WIDTH, HEIGHT, y1, y0, x0, x1, peak, lines, minutes)


@dataclass(frozen=True, slots=True)
class Trend:
    """Where the backlog goes: ``state`` idle, keeping-up, draining, holding, behind or stuck."""

    state: str
    words: str


def rate_words(value: float) -> str:
    """A rate for people: rows per minute with thousands separators, a decimal below 10."""
    whole = value >= 10 or value == int(value)
    return f"{value:,.0f}/min" if whole else f"{value:.1f}/min"


def _duration(minutes: float) -> str:
    if minutes < 1:
        return "under a minute"
    if minutes < 120:
        return f"about {minutes:.0f} min"
    return f"about {minutes / 60:.1f} h"


def trend(
    *,
    backlog: int,
    written: Sequence[int],
    confirmed: Sequence[int],
    failed: Sequence[int],
    sampled: bool = True,
) -> Trend:
    """Draining or stuck, in words, from the backlog now (pending and in flight) and the last
    minutes' rates: rows leave the backlog confirmed or failed, and join it written.
    ``sampled``: False when no publisher recorded its figures in the window: the rates are not
    known (no publisher ran, or none could reach the database), which the words say."""
    w, c, f = recent_rate(written), recent_rate(confirmed), recent_rate(failed)
    rates = f"confirming {rate_words(c)}, writing {rate_words(w)}"
    if f:
        rates += f", failing {rate_words(f)}"
    waiting = f"{backlog:,} row{'s' if backlog != 1 else ''} waiting"
    if backlog == 0:
        if w == 0 and c == 0:
            quiet = f"nothing written in the last {RECENT_MINUTES} min"
            return Trend("idle", f"Idle: nothing waiting, {quiet}.")
        return Trend("keeping-up", f"Keeping up: {rates}; nothing waiting.")
    caveat = "" if sampled else " No publisher recorded its figures in the last hour."
    net = c + f - w
    if c == 0 and f == 0:
        recent = f"nothing confirmed or failed in the last {RECENT_MINUTES} min"
        return Trend("stuck", f"Stuck: {waiting} and {recent}.{caveat}")
    if net > 0:
        empty = _duration(backlog / net)
        return Trend(
            "draining", f"Draining: {rates}; backlog falling ({waiting}, empty in {empty}).{caveat}"
        )
    if net == 0:
        return Trend("holding", f"Holding: {rates}; backlog flat ({waiting}).{caveat}")
    return Trend("behind", f"Falling behind: {rates}; backlog growing ({waiting}).{caveat}")
