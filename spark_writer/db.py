"""The database side of the writer: psycopg 3 (COPY) for PostgreSQL, sqlite3 for SQLite.

Only a URL comes in: executors import nothing of the service. A partition's rows go in with
``available_at`` parked far in the future, so no publisher claims them; ``commit_batch`` releases
all rows of the batch and records it in one transaction, and ``abort_batch`` removes them. So a
batch becomes visible whole or not at all, and a replayed batch adds no row
(``ON CONFLICT (message_id) DO NOTHING``).
"""

from __future__ import annotations

import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, Self

import psycopg

from spark_writer.envelope import BatchRef, Envelope, Rejected
from spark_writer.errors import OutboxConfigError

#: ``available_at`` of rows whose batch is not committed yet (never due).
PARKED = "9999-12-31 00:00:00"
_COLUMNS = (
    "message_id, batch_id, exchange, routing_key, mandatory, body, content_type, headers, "
    "ordering_key, available_at"
)


class Store(ABC):
    """What the writer needs from a database: one connection, used by one thread, a context."""

    @abstractmethod
    def batch_recorded(self, batch: BatchRef) -> bool: ...

    @abstractmethod
    def write(
        self, *, batch: BatchRef, envelopes: Iterable[Envelope], rejects: Sequence[Rejected]
    ) -> int:
        """Insert one partition in one transaction; return the rows new to the outbox.

        ``rejects`` is read after ``envelopes`` is used up, so it may be filled meanwhile.
        """

    @abstractmethod
    def commit_batch(self, *, batch: BatchRef, row_count: int, rejected_count: int) -> bool:
        """Release the batch's parked rows and record it; False when it was recorded before."""

    @abstractmethod
    def abort_batch(self, *, batch: BatchRef) -> None:
        """Remove the parked rows and rejects of a batch that was not recorded."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_store(url: str) -> Store:
    """A ``Store`` for ``url`` (``postgresql[+driver]://`` or ``sqlite:///PATH``), as a context."""
    if url.startswith("sqlite"):
        return SqliteStore(sqlite_path(url))
    if url.startswith(("postgresql", "postgres://")):
        return PostgresStore(pg_conninfo(url))
    raise OutboxConfigError(f"unsupported database URL scheme: {url.split(':', 1)[0]!r}")


def pg_conninfo(url: str) -> str:
    """``postgresql+psycopg://u:p@h/db`` → ``postgresql://u:p@h/db`` for libpq."""
    return "postgresql://" + url.split("://", 1)[1]


def sqlite_path(url: str) -> str:
    """``sqlite:///rel.db`` → ``rel.db``; ``sqlite:////abs/x.db`` → ``/abs/x.db``."""
    parts = url.split(":///", 1)
    path = parts[1].split("?", 1)[0] if len(parts) == 2 else ""
    if not path or path == ":memory:":
        raise OutboxConfigError("SQLite needs a file: sqlite:///PATH (executors open it too)")
    return path


def _reject_params(batch: BatchRef, r: Rejected) -> tuple[Any, ...]:
    return (
        batch.key,
        batch.sink,
        r.message_id,
        r.problem.detail,
        r.row_json,
        batch.key,
        r.message_id,
    )


def _batch_params(batch: BatchRef, row_count: int, rejected_count: int) -> tuple[Any, ...]:
    return (batch.key, batch.sink, batch.spark_batch_id, batch.query_id, row_count, rejected_count)


class PostgresStore(Store):
    """COPY into a temporary staging table, then one ``INSERT … ON CONFLICT DO NOTHING``."""

    STAGE = (
        "CREATE TEMP TABLE outbox_stage (pos bigint, message_id text, exchange text, "
        "routing_key text, mandatory boolean, body bytea, content_type text, headers text, "
        "ordering_key text) ON COMMIT DROP"
    )
    COPY = "COPY outbox_stage FROM STDIN (FORMAT BINARY)"
    TYPES = ("int8", "text", "text", "text", "bool", "bytea", "text", "text", "text")
    INSERT = (
        f"INSERT INTO outbox ({_COLUMNS}) SELECT message_id, %s, exchange, routing_key, "
        "mandatory, body, content_type, headers::json, ordering_key, %s::timestamptz "
        "FROM outbox_stage ORDER BY pos ON CONFLICT (message_id) DO NOTHING"
    )
    REJECT = (
        "INSERT INTO outbox_rejects (batch_id, sink, message_id, reason, row_json) "
        "SELECT %s::text, %s::text, %s::text, %s::text, %s::text WHERE NOT EXISTS "
        "(SELECT 1 FROM outbox_rejects WHERE batch_id = %s AND message_id = %s)"
    )
    PARKED = PARKED + "+00"

    def __init__(self, conninfo: str) -> None:
        self.conn = psycopg.connect(conninfo, autocommit=True)

    def close(self) -> None:
        self.conn.close()

    def batch_recorded(self, batch: BatchRef) -> bool:
        row = self.conn.execute(
            "SELECT 1 FROM outbox_batches WHERE batch_id = %s", (batch.key,)
        ).fetchone()
        return row is not None

    def write(
        self, *, batch: BatchRef, envelopes: Iterable[Envelope], rejects: Sequence[Rejected]
    ) -> int:
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute(self.STAGE)
            with cur.copy(self.COPY) as copy:
                copy.set_types(list(self.TYPES))
                for envelope in envelopes:
                    copy.write_row(envelope)
            cur.execute(self.INSERT, (batch.key, self.PARKED))
            inserted = cur.rowcount
            if rejects:
                cur.executemany(self.REJECT, [_reject_params(batch, r) for r in rejects])
        return inserted

    def commit_batch(self, *, batch: BatchRef, row_count: int, rejected_count: int) -> bool:
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute(
                "UPDATE outbox SET available_at = now() WHERE batch_id = %s "
                "AND available_at = %s::timestamptz AND status = 'pending'",
                (batch.key, self.PARKED),
            )
            cur.execute(
                "INSERT INTO outbox_batches (batch_id, sink, spark_batch_id, query_id, row_count, "
                "rejected_count) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (batch_id) DO NOTHING",
                _batch_params(batch, row_count, rejected_count),
            )
            return cur.rowcount == 1

    def abort_batch(self, *, batch: BatchRef) -> None:
        with self.conn.transaction(), self.conn.cursor() as cur:
            if self.batch_recorded(batch):
                return
            cur.execute(
                "DELETE FROM outbox WHERE batch_id = %s AND available_at = %s::timestamptz "
                "AND status = 'pending'",
                (batch.key, self.PARKED),
            )
            cur.execute("DELETE FROM outbox_rejects WHERE batch_id = %s", (batch.key,))


class SqliteStore(Store):
    """WAL mode; each partition is one ``BEGIN IMMEDIATE`` transaction with ``executemany``."""

    INSERT = (
        f"INSERT INTO outbox ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (message_id) DO NOTHING"
    )
    REJECT = (
        "INSERT INTO outbox_rejects (batch_id, sink, message_id, reason, row_json) "
        "SELECT ?, ?, ?, ?, ? WHERE NOT EXISTS "
        "(SELECT 1 FROM outbox_rejects WHERE batch_id = ? AND message_id = ?)"
    )
    BUSY_MS = 120_000

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, timeout=self.BUSY_MS / 1000, isolation_level=None)
        for pragma in ("journal_mode=WAL", "synchronous=FULL", f"busy_timeout={self.BUSY_MS}"):
            self.conn.execute(f"PRAGMA {pragma}")

    def close(self) -> None:
        self.conn.close()

    def batch_recorded(self, batch: BatchRef) -> bool:
        cur = self.conn.execute("SELECT 1 FROM outbox_batches WHERE batch_id = ?", (batch.key,))
        return cur.fetchone() is not None

    def write(
        self, *, batch: BatchRef, envelopes: Iterable[Envelope], rejects: Sequence[Rejected]
    ) -> int:
        # Map the whole partition first: SQLite has one writer, so hold its lock briefly.
        params = [
            (
                e.message_id,
                batch.key,
                e.exchange,
                e.routing_key,
                int(e.mandatory),
                e.body,
                e.content_type,
                e.headers,
                e.ordering_key,
                PARKED,
            )
            for e in envelopes
        ]
        with self._transaction():
            before = self.conn.total_changes
            self.conn.executemany(self.INSERT, params)
            inserted = self.conn.total_changes - before
            self.conn.executemany(self.REJECT, [_reject_params(batch, r) for r in rejects])
        return inserted

    def commit_batch(self, *, batch: BatchRef, row_count: int, rejected_count: int) -> bool:
        with self._transaction():
            self.conn.execute(
                "UPDATE outbox SET available_at = CURRENT_TIMESTAMP WHERE batch_id = ? "
                "AND available_at = ? AND status = 'pending'",
                (batch.key, PARKED),
            )
            cur = self.conn.execute(
                "INSERT INTO outbox_batches (batch_id, sink, spark_batch_id, query_id, row_count, "
                "rejected_count) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (batch_id) DO NOTHING",
                _batch_params(batch, row_count, rejected_count),
            )
            return cur.rowcount == 1

    def abort_batch(self, *, batch: BatchRef) -> None:
        with self._transaction():
            if self.batch_recorded(batch):
                return
            self.conn.execute(
                "DELETE FROM outbox WHERE batch_id = ? AND available_at = ? AND status = 'pending'",
                (batch.key, PARKED),
            )
            self.conn.execute("DELETE FROM outbox_rejects WHERE batch_id = ?", (batch.key,))

    def _transaction(self) -> _SqliteTransaction:
        return _SqliteTransaction(self.conn)


class _SqliteTransaction:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.conn.execute("COMMIT" if t is None else "ROLLBACK")
