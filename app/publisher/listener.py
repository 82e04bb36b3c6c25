"""New rows wake the claimer at once: PostgreSQL ``LISTEN outbox_new``, polling as the fallback.

A statement-level trigger (migration 0008) sends ``NOTIFY outbox_new`` when rows are inserted into
the outbox (one notification per statement and transaction, whatever its size: a Spark COPY of
100,000 rows is one), and operators' republish and skip notify too. The listener holds one extra
connection per publisher, outside the DB thread, and turns each notification into a wake-up of
the claimer. If the connection fails it logs, backs off and listens again; meanwhile the claimer
polls every ``poll_interval`` as it always does, so a lost notification only costs a poll.
SQLite has no notifications: the claimer polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import psycopg
from sqlalchemy import make_url

from app.logs import redact_url

log = logging.getLogger(__name__)

CHANNEL = "outbox_new"
RETRY_MIN, RETRY_MAX = 1.0, 30.0


def libpq_conninfo(url: str) -> str | None:
    """The libpq URL of a SQLAlchemy PostgreSQL URL; None for any other database."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("postgresql"):
        return None
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


class Listener:
    """``LISTEN`` on its own connection; ``wake()`` for every notification."""

    def __init__(self, *, url: str, wake: Callable[[], None]) -> None:
        self.conninfo = libpq_conninfo(url)
        self.url = url
        self.wake = wake
        self.listening = False
        self.notifications = 0
        self._stopped = asyncio.Event()

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
                log.warning(
                    "LISTEN %s on %s failed (%s); polling meanwhile, again in %.0fs",
                    CHANNEL,
                    redact_url(self.url),
                    exc,
                    delay,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), delay)
                delay = min(RETRY_MAX, delay * 2)

    async def _listen(self) -> None:
        assert self.conninfo is not None
        conn = await psycopg.AsyncConnection.connect(
            self.conninfo, autocommit=True, connect_timeout=10
        )
        async with conn:
            await conn.execute(f"LISTEN {CHANNEL}")
            self.listening = True
            log.info("listening for new rows (LISTEN %s)", CHANNEL)
            self.wake()  # rows committed while we were not listening
            while not self._stopped.is_set():
                # a bounded wait: notice a stop, and a dead connection (the server checks it)
                async for _ in conn.notifies(timeout=5.0, stop_after=1000):
                    self.notifications += 1
                    self.wake()
                await conn.execute("SELECT 1")
        self.listening = False
