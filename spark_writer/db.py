"""The database side of the writer: psycopg 3 (binary COPY) for PostgreSQL, sqlite3 for SQLite.

Only a URL comes in: executors import nothing of the service. Each partition is one
transaction; its rows are due (``available_at`` = now) when it commits. ``record_batch`` writes
the ``outbox_batches`` row once every partition succeeded. Re-running a batch adds no row:
``message_id`` is unique and a conflicting row is skipped (``ON CONFLICT DO NOTHING``).
"""

from __future__ import annotations

import sqlite3
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from types import TracebackType
from typing import IO, Any, Self

import psycopg
from psycopg import errors as pg_errors

from spark_writer.envelope import BatchRef, Chunk, Layout, Rejected
from spark_writer.errors import OutboxConfigError
from spark_writer.pgcopy import SIGNATURE, Const, encode


class Store(ABC):
    """What the writer needs from a database: one connection, used by one thread, a context."""

    @abstractmethod
    def batch_recorded(self, batch: BatchRef) -> bool: ...

    @abstractmethod
    def write(
        self,
        *,
        batch: BatchRef,
        layout: Layout,
        chunks: Iterable[Chunk],
        rejects: Sequence[Rejected],
        first_attempt: bool,
    ) -> int:
        """Insert one partition in one transaction; return the rows new to the outbox.

        ``rejects`` is read after ``chunks`` is used up, so it may be filled meanwhile.
        ``first_attempt``: no earlier attempt of this task can have written these rows.
        """

    @abstractmethod
    def record_batch(self, *, batch: BatchRef, row_count: int, rejected_count: int) -> bool:
        """Record the batch in ``outbox_batches``; False when it was recorded before."""

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


def _columns(layout: Layout) -> list[str]:
    return [*layout.varying, *(name for name, _ in layout.constant)]


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


_RECORD = (
    "INSERT INTO outbox_batches (batch_id, sink, spark_batch_id, query_id, row_count, "
    "rejected_count) VALUES ({0}, {0}, {0}, {0}, {0}, {0}) ON CONFLICT (batch_id) DO NOTHING"
)
_REJECT = (
    "INSERT INTO outbox_rejects (batch_id, sink, message_id, reason, row_json) "
    "SELECT {0}, {0}, {0}, {0}, {0} WHERE NOT EXISTS "
    "(SELECT 1 FROM outbox_rejects WHERE batch_id = {0} AND message_id = {0})"
)


class PostgresStore(Store):
    """A first attempt COPYs straight into ``outbox`` (the fast path: no second copy of the
    rows). A ``message_id`` already there fails that COPY; the partition then goes again
    through a staging table and one ``INSERT … SELECT … ON CONFLICT DO NOTHING``, replaying
    the COPY data kept in a spool. Retried tasks take the staging path at once."""

    #: Spool held in memory up to this size, then in a temporary file.
    SPOOL_MEMORY = 64 * 1024 * 1024
    TYPES = {
        "message_id": "text",
        "batch_id": "text",
        "exchange": "text",
        "routing_key": "text",
        "mandatory": "boolean",
        "body": "bytea",
        "content_type": "text",
        "headers": "json",
        "ordering_key": "text",
    }
    REJECT = _REJECT.format("%s")
    RECORD = _RECORD.format("%s")

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
        self,
        *,
        batch: BatchRef,
        layout: Layout,
        chunks: Iterable[Chunk],
        rejects: Sequence[Rejected],
        first_attempt: bool,
    ) -> int:
        data = _encoded(layout, chunks)
        columns = ", ".join(_columns(layout))
        with tempfile.SpooledTemporaryFile(max_size=self.SPOOL_MEMORY) as spool:
            if first_attempt:
                try:
                    return self._direct(columns, _spooled(data, spool), batch, rejects)
                except pg_errors.UniqueViolation:
                    spool.seek(0)
            replay = _replay(spool) if first_attempt else iter(())
            return self._staged(layout, columns, _chain(replay, data), batch, rejects)

    def _direct(
        self, columns: str, data: Iterator[bytes], batch: BatchRef, rejects: Sequence[Rejected]
    ) -> int:
        with self.conn.transaction(), self.conn.cursor() as cur:
            self._copy(cur, f"outbox ({columns})", data)
            inserted = cur.rowcount
            self._rejects(cur, batch, rejects)
        return inserted

    def _staged(
        self,
        layout: Layout,
        columns: str,
        data: Iterator[bytes],
        batch: BatchRef,
        rejects: Sequence[Rejected],
    ) -> int:
        typed = ", ".join(f"{name} {self.TYPES[name]}" for name in _columns(layout))
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute("SET LOCAL jit = off")
            cur.execute("SET LOCAL work_mem = '64MB'")  # sort the staged rows in memory
            cur.execute(f"CREATE TEMP TABLE outbox_stage (pos bigserial, {typed}) ON COMMIT DROP")
            self._copy(cur, f"outbox_stage ({columns})", data)
            cur.execute(
                f"INSERT INTO outbox ({columns}) SELECT {columns} FROM outbox_stage "
                "ORDER BY pos ON CONFLICT (message_id) DO NOTHING"
            )
            inserted = cur.rowcount
            self._rejects(cur, batch, rejects)
        return inserted

    @staticmethod
    def _copy(cur: psycopg.Cursor[Any], target: str, data: Iterator[bytes]) -> None:
        with cur.copy(f"COPY {target} FROM STDIN (FORMAT BINARY)") as copy:
            copy.write(SIGNATURE)
            for block in data:
                copy.write(block)

    def _rejects(
        self, cur: psycopg.Cursor[Any], batch: BatchRef, rejects: Sequence[Rejected]
    ) -> None:
        if rejects:
            cur.executemany(self.REJECT, [_reject_params(batch, r) for r in rejects])

    def record_batch(self, *, batch: BatchRef, row_count: int, rejected_count: int) -> bool:
        cur = self.conn.execute(self.RECORD, _batch_params(batch, row_count, rejected_count))
        return cur.rowcount == 1


def _encoded(layout: Layout, chunks: Iterable[Chunk]) -> Iterator[bytes]:
    constants = [Const.of(value) for _, value in layout.constant]
    for chunk in chunks:
        if chunk.rows:
            yield encode([*chunk.columns, *constants])


def _spooled(data: Iterator[bytes], spool: IO[bytes]) -> Iterator[bytes]:
    for block in data:
        spool.write(block)
        yield block


def _replay(spool: IO[bytes]) -> Iterator[bytes]:
    return iter(lambda: spool.read(1 << 20), b"")


def _chain(*parts: Iterator[bytes]) -> Iterator[bytes]:
    for part in parts:
        yield from part


class SqliteStore(Store):
    """WAL mode; each partition is one ``BEGIN IMMEDIATE`` transaction with ``executemany``."""

    BUSY_MS = 120_000
    REJECT = _REJECT.format("?")
    RECORD = _RECORD.format("?")

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
        self,
        *,
        batch: BatchRef,
        layout: Layout,
        chunks: Iterable[Chunk],
        rejects: Sequence[Rejected],
        first_attempt: bool,
    ) -> int:
        columns = _columns(layout)
        constants = [int(v) if isinstance(v, bool) else v for _, v in layout.constant]
        # Map the whole partition first: SQLite has one writer, so hold its lock briefly.
        params: list[tuple[Any, ...]] = []
        for chunk in chunks:
            values = [c.to_pylist() for c in chunk.columns]
            params += zip(*values, *(repeat(v) for v in constants))  # noqa: B905 (repeat)
        insert = (
            f"INSERT INTO outbox ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
            "ON CONFLICT (message_id) DO NOTHING"
        )
        with self._transaction():
            before = self.conn.total_changes
            self.conn.executemany(insert, params)
            inserted = self.conn.total_changes - before
            self.conn.executemany(self.REJECT, [_reject_params(batch, r) for r in rejects])
        return inserted

    def record_batch(self, *, batch: BatchRef, row_count: int, rejected_count: int) -> bool:
        with self._transaction():
            cur = self.conn.execute(self.RECORD, _batch_params(batch, row_count, rejected_count))
            return cur.rowcount == 1

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
