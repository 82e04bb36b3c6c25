"""A settable wall clock for the outbox's clients: tests move time instead of waiting for it."""

from __future__ import annotations

import datetime as dt

T0 = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)


class Clock:
    def __init__(self, now: dt.datetime = T0) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)
