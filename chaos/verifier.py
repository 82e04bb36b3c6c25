"""The independent verifier: a consumer that records every message it receives in PostgreSQL.

Its own AMQP connection (aiormq, not the product's client), manual acks, a prefetch window. Each
delivery is written to ``received`` (key: run, message_id, attempt) *before* it is acked, so a
verifier that loses its connection loses nothing: the broker redelivers and the row's
``deliveries`` counter goes up.

Why the key holds the attempt: every publish of a row carries ``x-outbox-attempt``, and a row is
claimed (attempt + 1) before each publish. Two copies of one ``message_id`` with different
attempts are two publishes (a publisher-side duplicate); the same (message_id, attempt) seen again
is the broker redelivering to the consumer (not the publisher's doing). Both are counted, apart.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiormq
import psycopg
from aiormq.abc import DeliveredMessage

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS received (
    run         text        NOT NULL,
    message_id  text        NOT NULL,
    attempt     integer     NOT NULL,
    deliveries  integer     NOT NULL,
    redelivered integer     NOT NULL DEFAULT 0,
    first_at    timestamptz NOT NULL DEFAULT now(),
    -- arrival order of first deliveries: rows of a batch are inserted in delivery order and
    -- an upsert keeps the first value
    seq         bigserial   NOT NULL,
    CONSTRAINT pk_received PRIMARY KEY (run, message_id, attempt)
)
"""
UPSERT = """
INSERT INTO received (run, message_id, attempt, deliveries, redelivered)
SELECT %(run)s, m, a, d, r FROM unnest(%(ids)s::text[], %(attempts)s::int[], %(deliveries)s::int[],
                                       %(redelivered)s::int[]) AS v(m, a, d, r)
ON CONFLICT (run, message_id, attempt) DO UPDATE
   SET deliveries = received.deliveries + EXCLUDED.deliveries,
       redelivered = received.redelivered + EXCLUDED.redelivered
"""


def _conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@dataclass(frozen=True)
class Received:
    """What the verifier's table says about one run."""

    copies: dict[str, int]  # message_id -> distinct publishes seen (distinct attempts)
    deliveries: int  # every delivery, redeliveries to the consumer included
    records: int  # distinct (message_id, attempt)
    #: message_id -> copies of an (id, attempt) already seen that the broker did not flag
    #: ``redelivered``: published again under an attempt number already used (a failover undid
    #: the claim that had counted it, so the next claim gave the same number again)
    same_attempt: dict[str, int] = field(default_factory=dict)

    @property
    def ids(self) -> set[str]:
        return set(self.copies)

    @property
    def duplicates(self) -> int:
        """Publisher-side duplicates: extra copies of a message_id, with another attempt
        number or unflagged with the same one."""
        return self.records - len(self.copies) + sum(self.same_attempt.values())

    @property
    def redeliveries(self) -> int:
        """Consumer-side redeliveries (same publish delivered again after a lost ack)."""
        return self.deliveries - self.records - sum(self.same_attempt.values())

    def duplicated_ids(self) -> set[str]:
        return {m for m, n in self.copies.items() if n > 1} | {
            m for m, n in self.same_attempt.items() if n
        }


@dataclass(slots=True)
class _Delivery:
    message_id: str
    attempt: int
    redelivered: bool
    channel: Any
    tag: int


@dataclass
class Verifier:
    """Consumes ``queues`` on its own connection(s) until :meth:`stop`; reconnects when the
    broker goes away. ``prefetch`` and ``flush_interval`` bound its speed (a slow consumer:
    at most ``prefetch`` messages per flush)."""

    amqp_url: str
    db_url: str
    run: str
    queues: tuple[str, ...]
    prefetch: int = 500
    flush_interval: float = 0.05
    seen_ids: set[str] = field(default_factory=set)
    connects: int = 0
    db_errors: int = 0
    _buffer: list[_Delivery] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: bool = False
    _db: psycopg.AsyncConnection[Any] | None = None
    _last_flush: float = 0.0

    # ------------------------------------------------------------ lifecycle

    @staticmethod
    def ensure_schema(db_url: str) -> None:
        """Create the table, emptied of earlier matrix runs."""
        with psycopg.connect(_conninfo(db_url), autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS received")
            conn.execute(SCHEMA)

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._consume_forever(), name="verifier-consume"),
            asyncio.create_task(self._flush_forever(), name="verifier-flush"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._flush()
        if self._db is not None:
            with contextlib.suppress(Exception):
                await self._db.close()

    @property
    def backlog(self) -> int:
        return len(self._buffer)

    # ------------------------------------------------------------ consuming

    async def _consume_forever(self) -> None:
        delay = 0.1
        while not self._stopping:
            try:
                await self._consume_once()
                delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker away, connection closed: try again
                log.info("verifier: connection ended: %r", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _consume_once(self) -> None:
        conn = await asyncio.wait_for(aiormq.connect(self.amqp_url), timeout=10)
        try:
            self.connects += 1
            channel = await conn.channel()
            await channel.basic_qos(prefetch_count=self.prefetch)

            async def on_message(message: DeliveredMessage) -> None:
                self._on_message(channel, message)

            for queue in self.queues:
                await channel.basic_consume(queue, on_message, no_ack=False)
            await conn.closing
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=5)

    def _on_message(self, channel: Any, message: DeliveredMessage) -> None:
        props = message.header.properties
        headers = props.headers or {}
        raw = headers.get("x-outbox-attempt", 0)
        attempt = raw if isinstance(raw, int) else -1  # -1: not an outbox publish
        self._buffer.append(
            _Delivery(
                props.message_id or "",
                attempt,
                bool(message.redelivered),
                channel,
                int(message.delivery_tag or 0),
            )
        )

    # ------------------------------------------------------------ recording

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            try:
                await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.db_errors += 1
                log.info("verifier: recording failed, retrying: %r", exc)
                if self._db is not None:
                    with contextlib.suppress(Exception):
                        await self._db.close()
                self._db = None
                await asyncio.sleep(0.5)

    async def _flush(self) -> None:
        if not self._buffer:
            return
        batch = list(self._buffer)
        await self._record(batch)
        del self._buffer[: len(batch)]
        self.seen_ids.update(d.message_id for d in batch)
        self._last_flush = time.monotonic()
        await self._ack(batch)

    async def _record(self, batch: list[_Delivery]) -> None:
        counts: collections.Counter[tuple[str, int]] = collections.Counter()
        again: collections.Counter[tuple[str, int]] = collections.Counter()
        for d in batch:
            counts[(d.message_id, d.attempt)] += 1
            again[(d.message_id, d.attempt)] += int(d.redelivered)
        keys = list(counts)
        params = {
            "run": self.run,
            "ids": [k[0] for k in keys],
            "attempts": [k[1] for k in keys],
            "deliveries": [counts[k] for k in keys],
            "redelivered": [again[k] for k in keys],
        }
        if self._db is None or self._db.closed:
            self._db = await psycopg.AsyncConnection.connect(
                _conninfo(self.db_url), connect_timeout=5
            )
        async with self._db.transaction():
            await self._db.execute(UPSERT, params)

    @staticmethod
    async def _ack(batch: Iterable[_Delivery]) -> None:
        """Ack the newest delivery of each channel with ``multiple``; a closed channel's
        deliveries come back from the broker (recorded again as redeliveries)."""
        last: dict[int, _Delivery] = {}
        for d in batch:
            last[id(d.channel)] = d
        for d in last.values():
            if d.channel.is_closed:
                continue
            with contextlib.suppress(Exception):
                await d.channel.basic_ack(d.tag, multiple=True)

    # ------------------------------------------------------------ results

    def first_arrivals(self) -> list[str]:
        """Message ids in the order of their first delivery (any attempt)."""
        with psycopg.connect(_conninfo(self.db_url), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT message_id FROM received WHERE run = %s GROUP BY message_id "
                "ORDER BY min(seq)",
                (self.run,),
            ).fetchall()
        return [m for (m,) in rows]

    def results(self) -> Received:
        """Read back the table (not the in-memory mirror) for this run."""
        with psycopg.connect(_conninfo(self.db_url), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT message_id, count(*), sum(deliveries), "
                "sum(greatest(deliveries - redelivered - 1, 0)) FROM received WHERE run = %s "
                "GROUP BY message_id",
                (self.run,),
            ).fetchall()
        copies = {m: int(n) for m, n, _, _ in rows}
        return Received(
            copies=copies,
            deliveries=sum(int(d) for _, _, d, _ in rows),
            records=sum(copies.values()),
            same_attempt={m: int(s) for m, _, _, s in rows if s},
        )

    async def queue_depth(self) -> int | None:
        """Ready messages left in the verifier's queues (None if the broker is away)."""
        try:
            conn = await asyncio.wait_for(aiormq.connect(self.amqp_url), timeout=5)
        except Exception:
            return None
        try:
            channel = await conn.channel()
            total = 0
            for queue in self.queues:
                ok = await channel.queue_declare(queue, passive=True)
                total += int(ok.message_count or 0)
            return total
        except Exception:
            return None
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=5)

    async def settle(self, expected: set[str], *, timeout: float, quiet: float = 1.0) -> bool:
        """Wait until every expected id was recorded and the queues stay empty for ``quiet``
        seconds (straggling duplicates arrive too). False on timeout."""
        deadline = time.monotonic() + timeout
        calm_since: float | None = None
        while time.monotonic() < deadline:
            done = expected <= self.seen_ids and not self._buffer
            depth = await self.queue_depth() if done else None
            if done and depth == 0:
                calm_since = calm_since or time.monotonic()
                if time.monotonic() - calm_since >= quiet:
                    return True
            else:
                calm_since = None
            await asyncio.sleep(0.1)
        return False
