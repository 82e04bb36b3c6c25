"""New rows wake the claimer at once: PostgreSQL ``LISTEN outbox_new``, polling as the fallback.

A statement-level trigger (migration 0008) sends ``NOTIFY outbox_new`` when rows are inserted into
the outbox (one notification per statement and transaction, whatever its size: a Spark COPY of
100,000 rows is one), and operators' republish and skip notify too. The listener holds one extra
connection per publisher, outside the DB thread, and turns each notification into a wake-up of
the claimer. If the connection fails it backs off and listens again; meanwhile the claimer
polls every ``poll_interval`` as it always does, so a lost notification only costs a poll. A
database outage is logged as the DB thread logs it: a WARNING at the first failure, a reminder
at most every :data:`REMINDER` seconds (each attempt at DEBUG), an INFO with the outage's length
when it listens again.
SQLite has no notifications: the claimer polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import psycopg
from sqlalchemy import make_url

from app.logs import redact_url

log = logging.getLogger(__name__)

CHANNEL = "outbox_new"
RETRY_MIN, RETRY_MAX = 1.0, 30.0
REMINDER = 60.0  # seconds between two warnings of one outage


def libpq_conninfo(url: str) -> str | None:
    """The libpq connection string of a SQLAlchemy PostgreSQL URL, as the engine's own psycopg
    dialect translates it (None for any other database). So the listener follows every URL form
    the engine does: a multi-host URL (``?host=a:5432&host=b:5432&target_session_attrs=
    read-write``) becomes ``host=a,b port=5432,5432``, and libpq tries the hosts in turn for the
    primary after a failover. Rendered back as a URL, libpq kept only the last ``host=`` and took
    ``b:5432`` for a host name: the listener never connected, and the claimer only polled."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("postgresql"):
        return None
    psycopg_url = parsed.set(drivername="postgresql+psycopg")
    _, params = psycopg_url.get_dialect()().create_connect_args(psycopg_url)
    return psycopg.conninfo.make_conninfo("", **params)


class Listener:
    """``LISTEN`` on its own connection; ``wake()`` for every notification."""

    def __init__(self, *, url: str, wake: Callable[[], None]) -> None:
        self.conninfo = libpq_conninfo(url)
        self.url = url
        self.wake = wake
        self.listening = False
        self.notifications = 0
        self._stopped = asyncio.Event()
        self._failing_since: float | None = None
        self._failures = 0
        self._told_at = 0.0

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        """Listen until stopped (PostgreSQL only: the engine runs it only with a conninfo)."""
        if self.conninfo is None:
            await self._stopped.wait()
            return
        delay = RETRY_MIN
        while not self._stopped.is_set():
            try:
                await self._listen()
                delay = RETRY_MIN
            except (psycopg.Error, OSError) as exc:
                self.listening = False
                self._failed(exc, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), delay)
                delay = min(RETRY_MAX, delay * 2)

    def _failed(self, exc: Exception, delay: float) -> None:
        now = time.monotonic()
        self._failures += 1
        if self._failing_since is None:
            self._failing_since = self._told_at = now
            level = logging.WARNING
        elif now - self._told_at >= REMINDER:
            self._told_at = now
            level = logging.WARNING
        else:
            level = logging.DEBUG
        log.log(
            level,
            "LISTEN %s on %s failed (%s; %d attempts over %.0fs); polling meanwhile, "
            "again in %.0fs",
            CHANNEL,
            redact_url(self.url),
            exc,
            self._failures,
            now - self._failing_since,
            delay,
        )

    async def _listen(self) -> None:
        assert self.conninfo is not None
        conn = await psycopg.AsyncConnection.connect(
            self.conninfo, autocommit=True, connect_timeout=10
        )
        async with conn:
            await conn.execute(f"LISTEN {CHANNEL}")
            self.listening = True
            if self._failing_since is None:
                log.info("listening for new rows (LISTEN %s)", CHANNEL)
            else:
                log.info(
                    "listening for new rows (LISTEN %s) again after %.1fs (%d attempts failed)",
                    CHANNEL,
                    time.monotonic() - self._failing_since,
                    self._failures,
                )
                self._failing_since, self._failures = None, 0
            self.wake()  # rows committed while we were not listening
            while not self._stopped.is_set():
                # a bounded wait: notice a stop, and a dead connection (the server checks it)
                async for _ in conn.notifies(timeout=5.0, stop_after=1000):
                    self.notifications += 1
                    self.wake()
                await conn.execute("SELECT 1")
        self.listening = False
