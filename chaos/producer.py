"""A steady producer: an application writing rows into the outbox at a fixed rate, through the
product's :func:`app.outbox.enqueue.enqueue`, on a thread of its own.

Each tick commits a few new rows (ids ``<run>-p<seq>``) in one transaction of its own. When the
commit fails (PostgreSQL down, a session killed), it retries the same rows until one commit
succeeds, as an application that must not drop its writes does: the ids are fixed, so a commit
that went through but whose reply was lost comes back as ``duplicates`` and is counted once. What
it counts as committed is exactly the rows a successful commit holds; the scenario expects every
one of them confirmed and received. With ``stream``, its rows name a RabbitMQ stream instead of
an exchange (21a-long, :mod:`chaos.streams`).
"""

from __future__ import annotations

import contextlib
import threading
import time

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from app.db import make_engine
from app.outbox.enqueue import Message, enqueue
from chaos import outbox as ob

PRODUCER_APP = "chaos-producer"


class SteadyProducer:
    """``rate`` rows a second, ``per_commit`` rows per transaction, until :meth:`stop`."""

    def __init__(
        self,
        *,
        db_url: str,
        exchange: str = "",
        routing_key: str = "",
        stream: str | None = None,
        prefix: str,
        rate: float = 50.0,
        per_commit: int = 10,
    ) -> None:
        self.exchange, self.routing_key, self.prefix = exchange, routing_key, prefix
        self.stream = stream  # rows for a RabbitMQ stream (exchange and routing key empty)
        self.per_commit = per_commit
        self.interval = per_commit / rate
        self.rate = rate
        self.committed: list[str] = []
        self.failed_commits = 0  # commits that raised (retried with the same rows)
        self.longest_failing = 0.0  # seconds, the longest run of failed commits
        self._engine: Engine = make_engine(
            db_url,
            connect_args={"application_name": PRODUCER_APP, "connect_timeout": 5},
            pool_pre_ping=True,
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="chaos-producer", daemon=True)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.committed)

    def start(self) -> SteadyProducer:
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        """Stop after the commit in progress (if it succeeds); the ids committed, in order."""
        self._stop.set()
        self._thread.join(timeout=60)
        with contextlib.suppress(Exception):
            self._engine.dispose()
        with self._lock:
            return list(self.committed)

    def _loop(self) -> None:
        seq = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            ids = [f"{self.prefix}-p{seq + i:07d}" for i in range(self.per_commit)]
            if not self._commit(ids):
                return
            seq += self.per_commit
            next_at = max(next_at + self.interval, time.monotonic() - 1.0)  # no burst after
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _commit(self, ids: list[str]) -> bool:
        """Commit ``ids`` (retrying until it works); False when stopped before it did."""
        failing_since: float | None = None
        messages = [
            Message(
                exchange=self.exchange,
                routing_key=self.routing_key,
                body=ob.body_for(int(m.rsplit("p", 1)[1])),
                message_id=m,
                stream=self.stream,
            )
            for m in ids
        ]
        while True:
            try:
                with self._engine.begin() as conn:
                    enqueue(conn, messages, source=f"{self.prefix}:producer")
            except DBAPIError:
                self.failed_commits += 1
                now = time.monotonic()
                failing_since = failing_since or now
                self.longest_failing = max(self.longest_failing, now - failing_since)
                if self._stop.wait(0.5):
                    return False
                continue
            with self._lock:
                self.committed.extend(ids)
            return True
