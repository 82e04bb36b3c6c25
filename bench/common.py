"""Shared pieces of the benchmark: sizes, throw-away databases, seeding, broker topology, timing.

Nothing here measures anything; the workloads in ``bench/workloads/`` do.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import psycopg
from psycopg import sql
from sqlalchemy import make_url

from app.db import migrate

BODY_SIZE = 256
BODY = bytes(range(256))[:BODY_SIZE]  # 256 bytes, not all one letter
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))


@dataclass(frozen=True)
class Sizes:
    """How much each workload moves at a given ``BENCH_SCALE``."""

    scale: float
    publish: int  # messages per windowed baseline run
    publish_each: int  # messages per publish-and-wait baseline run (slow by design)
    drain: int  # backlog rows per drain run
    latency_seconds: float  # steady-state part of the latency run
    spark: int  # DataFrame rows

    @classmethod
    def from_env(cls) -> Sizes:
        scale = float(os.environ.get("BENCH_SCALE", "1"))
        return cls(
            scale=scale,
            publish=int(20_000 * scale),
            publish_each=int(3_000 * scale),
            drain=int(100_000 * scale),
            latency_seconds=15.0 * min(scale, 4.0),
            spark=int(200_000 * scale),
        )


@dataclass(frozen=True)
class Services:
    amqp_url: str
    database_url: str  # SQLAlchemy URL of the local PostgreSQL (the ``outbox`` database)

    @property
    def broker_port(self) -> int:
        return urlsplit(self.amqp_url).port or 5672

    @property
    def database_port(self) -> int:
        return make_url(self.database_url).port or 5432

    @classmethod
    def from_env(cls) -> Services:
        return cls(
            amqp_url=os.environ.get("OUTBOX_AMQP_URL", "amqp://guest:guest@127.0.0.1:5673/"),
            database_url=os.environ.get(
                "OUTBOX_DATABASE_URL", "postgresql+psycopg://outbox:outbox@127.0.0.1:5433/outbox"
            ),
        )


def libpq_url(url: str) -> str:
    """``postgresql+psycopg://…`` (SQLAlchemy) → ``postgresql://…`` (libpq / psycopg)."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


# ----------------------------------------------------------------------------- databases


@contextlib.contextmanager
def temp_postgres(services: Services) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database; dropped afterwards. Yields its SQLAlchemy URL."""
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = libpq_url(services.database_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = with_database(services.database_url, name)
    try:
        migrate(url)
        _experiment_sql(url, name)
        yield url
    finally:
        _drop_database(admin, name)


def _experiment_sql(url: str, name: str) -> None:
    """``BENCH_PG_SQL``: statements (``;``-separated, ``{db}`` = the database name) run on each
    fresh database after the migration, to measure a what-if (say ``ALTER DATABASE {db} SET
    synchronous_commit = off``) without touching the product. Unset in a normal run."""
    script = os.environ.get("BENCH_PG_SQL", "").strip()
    if not script:
        return
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for stmt in filter(None, (s.strip() for s in script.split(";"))):
            conn.execute(stmt.replace("{db}", name).encode())


def _drop_database(admin: str, name: str) -> None:
    """Drop it, ending our own role's stragglers first (a publisher's pool). ``WITH (FORCE)``
    cannot be used: it fails when an autovacuum worker (another role) is in the database."""
    drop = sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name))
    kill = (
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = %s AND usename = current_user AND pid <> pg_backend_pid()"
    )
    for attempt in range(10):
        try:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(kill, (name,))
                conn.execute(drop)  # waits up to 5 s for other sessions (autovacuum) to leave
            return
        except psycopg.errors.ObjectInUse:
            if attempt == 9:
                raise
            time.sleep(0.5)


@contextlib.contextmanager
def temp_sqlite() -> Iterator[str]:
    """A fresh, migrated SQLite outbox file in a temp dir. Yields its SQLAlchemy URL."""
    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'outbox.db'}"
        migrate(url)
        yield url


def seed_postgres(
    url: str,
    *,
    n: int,
    exchange: str,
    routing_key: str,
    start: int = 0,
    keys: int | None = None,
    traced: bool = False,
) -> None:
    """Insert ``n`` pending rows with COPY (rows shaped like tests/support/factories.py); with
    ``keys``, row ``i`` has ordering key ``k{i % keys}`` (keys interleaved, as a stream writes
    them);
    ``traced``: each row carries a ``traceparent`` header of its own trace."""
    prefix = uuid.uuid4().hex[:8]
    copy = (
        "COPY outbox (message_id, batch_id, exchange, routing_key, body, ordering_key, headers)"
        " FROM STDIN"
    )
    with psycopg.connect(libpq_url(url)) as conn, conn.cursor() as cur:
        with cur.copy(copy) as cp:
            for i in range(start, start + n):
                key = None if keys is None else f"k{i % keys}"
                headers = None
                if traced:
                    headers = f'{{"traceparent": "00-{i + 1:032x}-{i + 1:016x}-01"}}'
                cp.write_row(
                    (
                        f"{prefix}-{i}",
                        f"bench:{i // 10_000}",
                        exchange,
                        routing_key,
                        BODY,
                        key,
                        headers,
                    )
                )
        conn.commit()
        cur.execute("ANALYZE outbox")
        conn.commit()


def seed_sqlite(url: str, *, n: int, exchange: str, routing_key: str) -> None:
    """Insert ``n`` pending rows with executemany in one transaction."""
    path = url.removeprefix("sqlite:///")
    prefix = uuid.uuid4().hex[:8]
    rows = (
        (f"{prefix}-{i}", f"bench:{i // 10_000}", exchange, routing_key, BODY) for i in range(n)
    )
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.executemany(
                "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body) "
                "VALUES (?, ?, ?, ?, ?)",
                rows,
            )
        conn.execute("ANALYZE")
    finally:
        conn.close()


# ------------------------------------------------------------------------------- broker


@dataclass
class Topology:
    """One durable direct exchange and one durable queue bound to it (classic unless
    ``queue_type`` says ``quorum``)."""

    services: Services
    tag: str
    exchange: str = ""
    queue: str = ""
    routing_key: str = "bench"
    #: ``x-max-length``: the queue keeps the newest messages (a long run's memory stays flat)
    max_length: int | None = None
    queue_type: str = "classic"

    def __post_init__(self) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.exchange = f"bench.{self.tag}.{suffix}"
        self.queue = f"bench.{self.tag}.{suffix}"

    def _channel(self) -> tuple[pika.BlockingConnection, Any]:
        conn = pika.BlockingConnection(pika.URLParameters(self.services.amqp_url))
        return conn, conn.channel()

    def declare(self) -> None:
        conn, ch = self._channel()
        try:
            ch.exchange_declare(self.exchange, exchange_type="direct", durable=True)
            arguments: dict[str, Any] = {"x-queue-type": self.queue_type}
            if self.max_length is not None:
                arguments["x-max-length"] = self.max_length
            ch.queue_declare(self.queue, durable=True, arguments=arguments)
            ch.queue_bind(self.queue, self.exchange, routing_key=self.routing_key)
        finally:
            conn.close()

    def depth(self) -> int:
        conn, ch = self._channel()
        try:
            ok = ch.queue_declare(self.queue, passive=True)
            return int(ok.method.message_count)
        finally:
            conn.close()

    def delete(self) -> None:
        conn, ch = self._channel()
        try:
            ch.queue_delete(self.queue)
            ch.exchange_delete(self.exchange)
        finally:
            conn.close()


@contextlib.contextmanager
def topology(
    services: Services, tag: str, *, max_length: int | None = None, queue_type: str = "classic"
) -> Iterator[Topology]:
    topo = Topology(services=services, tag=tag, max_length=max_length, queue_type=queue_type)
    topo.declare()
    try:
        yield topo
    finally:
        topo.delete()


# ------------------------------------------------------------------------------ results


@dataclass
class Measured:
    """All runs of one workload; ``value`` is their median."""

    key: str
    unit: str
    runs: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")


def repeat(key: str, unit: str, run: Callable[[], float], *, times: int = REPEATS) -> Measured:
    """Run ``run`` ``times`` times (each returns one figure) and print as it goes."""
    out = Measured(key=key, unit=unit)
    for i in range(times):
        figure = run()
        out.runs.append(figure)
        print(f"  {key} run {i + 1}/{times}: {figure:,.0f} {unit}", flush=True)
    return out


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("nan")


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
