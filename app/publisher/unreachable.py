"""The broker unreachable: since when, how many connection attempts failed, and its few log lines.

A broker down for ten minutes used to cost two log lines per connection attempt (a WARNING with
the error, an INFO with the next delay): hundreds of lines saying the same thing. An outage is now
logged as the database's is (:mod:`app.publisher.dbthread`):

- a WARNING when it begins (the first failed attempt, with the error);
- each further attempt at DEBUG;
- a WARNING reminder at most every :data:`REMINDER` seconds (how long, how many attempts);
- an INFO when a connection opens again, with the outage's length and its failed attempts.

The outage is dated from when the publisher lost its connection (or started without one), not
from the first failed attempt: a connection lost at 12:00 whose reconnects fail until 12:10 is a
ten-minute outage. No I/O here but the log; the clock is passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("app.publisher")

#: seconds between two "still unreachable" reminders of one outage
REMINDER = 60.0


class BrokerOutage:
    """The connection attempts of one publisher since it last had a connection."""

    def __init__(self, *, clock: Callable[[], float], reminder: float | None = None) -> None:
        self._clock = clock
        self._reminder = REMINDER if reminder is None else reminder
        self._disconnected_at: float | None = clock()  # no connection yet at start
        #: when the outage being logged began (None: not in an outage)
        self.since: float | None = None
        self.attempts = 0  # failed connection attempts of the outage
        self._told_at = 0.0

    def disconnected(self) -> None:
        """The connection died: an outage, if the next attempt fails, dates from now."""
        self._disconnected_at = self._clock()

    def failed(self, *, broker: str, error: object, retry_in: float) -> None:
        """A connection attempt failed; the next one is in ``retry_in`` seconds."""
        now = self._clock()
        self.attempts += 1
        if self.since is None:
            began = self._disconnected_at
            self.since = now if began is None else min(began, now)
            self._told_at = now
            log.warning(
                "cannot connect to the broker at %s: %s; retrying (next in %.1fs), quietly "
                "until it answers",
                broker,
                error,
                retry_in,
            )
            return
        if now - self._told_at >= self._reminder:
            self._told_at = now
            log.warning(
                "broker still unreachable after %.0fs, %d attempts; next in %.1fs (last error: %s)",
                now - self.since,
                self.attempts,
                retry_in,
                error,
            )
            return
        log.debug("connection attempt %d failed: %s; next in %.1fs", self.attempts, error, retry_in)

    def connected(self) -> None:
        """A connection opened: the outage (if any) ends, with one line saying how long."""
        if self.since is not None:
            log.info(
                "the broker answers again after %.1fs (%d connection attempts failed meanwhile)",
                self._clock() - self.since,
                self.attempts,
            )
        self.since, self.attempts, self._disconnected_at = None, 0, None

    def seconds(self) -> float:
        """How long the broker has been unreachable (0 when connected or not yet failing)."""
        return 0.0 if self.since is None else max(0.0, self._clock() - self.since)
