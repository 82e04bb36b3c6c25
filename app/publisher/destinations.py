"""Which exchanges are known to exist, which are backing off, and until when. Pure, no I/O.

An exchange is checked (passive ``exchange.declare`` on a scratch channel) the first time the
publisher sees it and again once its entry expires, so a row for a missing exchange never kills
the channel the other rows are flowing on. A missing or forbidden exchange backs off
exponentially; only its own rows wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from app.outbox.records import Backoff

DEFAULT_EXCHANGE = ""


class DestinationState(StrEnum):
    OK = "ok"  # exists (checked recently): publish
    UNKNOWN = "unknown"  # never checked or entry expired: check first
    CHECKING = "checking"  # a check is running: park the rows
    PAUSED = "paused"  # missing or forbidden: back off, rows retry later


@dataclass(slots=True)
class _Entry:
    state: DestinationState
    until: float
    failures: int = 0
    reason: str = ""


class Destinations:
    """Per-exchange state with expiry; ``now`` is a monotonic clock passed in by the caller."""

    def __init__(self, *, backoff: Backoff, ok_ttl: float = 60.0) -> None:
        self._backoff = backoff
        self._ok_ttl = ok_ttl
        self._entries: dict[str, _Entry] = {}

    def state(self, exchange: str, now: float) -> DestinationState:
        if exchange == DEFAULT_EXCHANGE:
            return DestinationState.OK
        entry = self._entries.get(exchange)
        if entry is None:
            return DestinationState.UNKNOWN
        if entry.state is DestinationState.CHECKING or now < entry.until:
            return entry.state
        return DestinationState.UNKNOWN

    def reason(self, exchange: str) -> str:
        entry = self._entries.get(exchange)
        return entry.reason if entry is not None else ""

    def checking(self, exchange: str) -> None:
        entry = self._entries.get(exchange)
        failures = entry.failures if entry is not None else 0
        self._entries[exchange] = _Entry(DestinationState.CHECKING, 0.0, failures)

    def clear(self) -> None:
        """A new connection: checks in flight on the old one will never answer."""
        self._entries = {k: e for k, e in self._entries.items()
                         if e.state is not DestinationState.CHECKING}  # fmt: skip

    def ok(self, exchange: str, now: float) -> None:
        self._entries[exchange] = _Entry(DestinationState.OK, now + self._ok_ttl)

    def unchecked(self, exchange: str, now: float) -> float:
        """A check could not run (no connection, no channel, a timeout): its rows stay parked
        and the check runs again after a backoff (returned, in seconds), never in a loop."""
        entry = self._entries.get(exchange)
        failures = (entry.failures if entry is not None else 0) + 1
        delay = self._backoff.delay(failures)
        self._entries[exchange] = _Entry(DestinationState.CHECKING, now + delay, failures,
                                         "check did not run")  # fmt: skip
        return delay

    def recheck(self, exchange: str) -> None:
        """The backoff after a check that did not run is over: check again."""
        entry = self._entries.get(exchange)
        if entry is not None and entry.state is DestinationState.CHECKING:
            self._entries[exchange] = _Entry(DestinationState.UNKNOWN, 0.0, entry.failures)

    def failed(self, exchange: str, reason: str, now: float) -> float:
        """The exchange is missing or forbidden: pause it; returns the pause in seconds."""
        entry = self._entries.get(exchange)
        failures = (entry.failures if entry is not None else 0) + 1
        delay = self._backoff.delay(failures)
        self._entries[exchange] = _Entry(DestinationState.PAUSED, now + delay, failures, reason)
        return delay

    def paused(self, now: float) -> dict[str, float]:
        """Exchanges backing off now -> seconds left."""
        return {
            name: entry.until - now
            for name, entry in self._entries.items()
            if entry.state is DestinationState.PAUSED and now < entry.until
        }
