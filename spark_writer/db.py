"""The database side of the writer: psycopg 3 (binary COPY) for PostgreSQL, sqlite3 for SQLite.

Only a URL comes in: executors import nothing of the service. Each partition is one
transaction; its rows are due (``available_at`` = now) when it commits, unless the writer asks
for all or nothing. Then either the driver first *holds* the batch (``hold``: one row in
``outbox_held``, and publishers claim no row of a held batch), or the tasks write the rows
*parked* (never due; the data source, whose driver has no hook before its tasks). In both,
``record_batch`` releases the rows in the transaction that records the batch, and
``discard_unrecorded`` removes them when the batch fails. ``record_batch`` writes the
``outbox_batches`` row once every partition succeeded. Re-running a batch adds no row:
``message_id`` is unique and a row whose id is there already is skipped (``ON CONFLICT DO
NOTHING``), but only when it is the same message (a replay). A row whose id the outbox holds for
another message (another sink, exchange, routing key, stream, body, headers, ...) is a
*conflict*: it rolls its partition back in fail mode, and goes to ``outbox_rejects`` with the
reason in reject mode. Message ids are one namespace across sinks, so a consumer can key on
``message_id`` alone.
"""

from __future__ import annotations

import json
import sqlite3
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from types import TracebackType
from typing import Any, NamedTuple, Self

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import make_conninfo

from app.outbox.replication import POSITIONS_NOW, STANDBYS_FLUSHED
from spark_writer.dburl import pg_conninfo, sqlite_path
from spark_writer.envelope import PARKED, BatchRef, Chunk, Layout, Problem, Rejected, jsonable
from spark_writer.errors import OutboxConfigError
from spark_writer.pgcopy import SIGNATURE, Const, encode

#: What makes two rows the same message, apart from the id: the sink (the ``batch_id``'s prefix)
#: and these columns.
CONTENT = (
    "exchange",
    "routing_key",
    "mandatory",
    "body",
    "content_type",
    "headers",
    "ordering_key",
    "properties",
    "stream",
)
CONFLICT = "message id already in the outbox for another message"


class Conflict(NamedTuple):
    """A row whose ``message_id`` the outbox holds for another message (or an earlier row of
    the same batch with other content): never skipped silently."""

    message_id: str
    #: the ``batch_id`` of the row holding the id
    holder: str
    #: what differs: ``sink`` and/or names of ``CONTENT``
    differs: tuple[str, ...]
    #: the refused message as JSON, for ``outbox_rejects``
    message_json: str

    @property
    def problem(self) -> Problem:
        return Problem(
            CONFLICT,
            f"message id {self.message_id!r} is held by a row of batch {self.holder} with "
            f"another {', '.join(self.differs)} (message ids are one namespace across sinks: "
            "use a key unique per message)",
        )


class KeyConflicts(Exception):
    """Raised out of ``Store.write`` in fail mode; the partition's transaction rolled back."""

    def __init__(self, conflicts: Sequence[Conflict]) -> None:
        self.conflicts = tuple(conflicts)
        super().__init__(f"{len(self.conflicts)} message id conflict(s)")


class Written(NamedTuple):
    """What one partition's transaction did: rows new to the outbox, and the conflicting rows
    it sent to ``outbox_rejects`` (reject mode)."""

    inserted: int
    conflicts: tuple[Conflict, ...] = ()


def _sink_of(batch_id: str | None) -> str | None:
    return None if batch_id is None else batch_id.split(":", 1)[0]


def _message_json(message: dict[str, Any]) -> str:
    doc = {k: message.get(k) for k in ("message_id", "batch_id", *CONTENT)}
    body = doc.get("body")
    if isinstance(body, bytes | bytearray | memoryview):
        raw = bytes(body)
        try:
            doc["body"] = raw.decode()
        except UnicodeDecodeError:
            doc["body_base64"] = jsonable(raw)
            del doc["body"]
    for name in ("headers", "properties"):
        value = doc.get(name)
        if isinstance(value, str):
            doc[name] = json.loads(value)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, default=str)


def _conflict_rejects(batch: BatchRef, conflicts: Sequence[Conflict]) -> list[tuple[Any, ...]]:
    return [
        _reject_params(batch, Rejected(-1, c.message_id, c.problem, c.message_json))
        for c in conflicts
    ]


class StandbyWait(NamedTuple):
    """What the wait for the standbys found after ``waited`` seconds: ``standbys``, whether any
    streams from this server; ``behind``, the bytes of WAL the slowest still lacks (0: every
    standby has the batch; None: this role may not read their positions)."""

    standbys: bool
    behind: int | None
    waited: float


class Store(ABC):
    """What the writer needs from a database: one connection, used by one thread, a context."""

    conn: Any  # psycopg.Connection (autocommit) or sqlite3.Connection (no implicit transaction)
    PARKED: str
    DISCARD: str
    HOLD: str
    UNHOLD: str
    DISCARD_HELD: str

    @abstractmethod
    def batch_recorded(self, batch: BatchRef) -> bool: ...

    def wait_for_standbys(self, timeout: float) -> StandbyWait:
        """Wait up to ``timeout`` s until every streaming standby has on disk everything
        committed so far (SQLite has none)."""
        return StandbyWait(standbys=False, behind=0, waited=0.0)

    @abstractmethod
    def write(
        self,
        *,
        batch: BatchRef,
        layout: Layout,
        chunks: Iterable[Chunk],
        rejects: Sequence[Rejected],
        first_attempt: bool,
        fail_on_conflict: bool,
        quiet: bool = False,
    ) -> Written:
        """Insert one partition in one transaction; return the rows new to the outbox and the
        conflicts sent to ``outbox_rejects``.

        ``rejects`` is read after ``chunks`` is used up, so it may be filled meanwhile.
        ``first_attempt``: no earlier attempt of this task can have written these rows.
        ``fail_on_conflict``: a conflict raises ``KeyConflicts`` and nothing is written.
        ``quiet``: the batch is held, so the insert wakes no publisher (PostgreSQL: its
        ``outbox_new`` notification is skipped; lifting the hold notifies instead).
        """

    def hold(self, batch: BatchRef) -> None:
        """Hold the batch: no publisher claims its rows until ``record_batch`` (driver side,
        before the tasks write). Holding a held batch again is a no-op."""
        self.conn.execute(self.HOLD, (batch.key,))

    @abstractmethod
    def record_batch(
        self, *, batch: BatchRef, row_count: int, rejected_count: int, release: bool = False
    ) -> bool:
        """Record the batch in ``outbox_batches`` and lift its hold; False when it was recorded
        before. ``release``: make the batch's parked rows due, in the same transaction."""

    def discard_unrecorded(self, batch: BatchRef) -> int:
        """Remove the rows of a batch that will not be recorded (parked, or of a held batch,
        and never claimed); how many there were. The hold stays: a task of the failed job
        still running (a speculative or cancelled attempt) commits into a held batch, never
        a published one; a re-run of the batch lifts the hold when it records the batch."""
        with self._transaction():
            parked = self.conn.execute(self.DISCARD, (batch.key, self.PARKED)).rowcount
            held = self.conn.execute(self.DISCARD_HELD, (batch.key, batch.key)).rowcount
            return int(parked) + int(held)

    @abstractmethod
    def _transaction(self) -> Any: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_store(url: str, *, password_file: str | None = None) -> Store:
    """A ``Store`` for ``url`` (``postgresql[+driver]://`` or ``sqlite:///PATH``), as a context.

    ``password_file``: a file on this machine holding the database password (a mounted secret),
    read here, in the executor, so the password is never in Spark's conf, plan, UI or event log.
    Without it, libpq's own ``PGPASSFILE`` / ``~/.pgpass`` / ``PGPASSWORD`` apply as usual."""
    if url.startswith("sqlite"):
        return SqliteStore(sqlite_path(url))
    if url.startswith(("postgresql", "postgres://")):
        password = read_password(password_file) if password_file is not None else None
        return PostgresStore(pg_conninfo(url), password=password)
    raise OutboxConfigError(f"unsupported database URL scheme: {url.split(':', 1)[0]!r}")


def read_password(path: str) -> str:
    """The first line of ``path`` (a secret file), or a clear error naming the file only."""
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise OutboxConfigError(
            f"password_file {path!r} cannot be read here ({type(exc).__name__}: "
            f"{getattr(exc, 'strerror', None) or exc}): it must exist on every executor "
            "(a mounted secret, or shipped with --files)"
        ) from None
    if not password:
        raise OutboxConfigError(f"password_file {path!r} is empty")
    return password


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


_HOLD = "INSERT INTO outbox_held (batch_id) VALUES ({0}) ON CONFLICT DO NOTHING"
_UNHOLD = "DELETE FROM outbox_held WHERE batch_id = {0}"
#: never-claimed rows of a held batch (a row a publisher took was not held when it took it)
_DISCARD_HELD = (
    "DELETE FROM outbox WHERE batch_id = {0} AND status = 'pending' AND attempts = 0 "
    "AND EXISTS (SELECT 1 FROM outbox_held WHERE batch_id = {0})"
)
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
    """One transaction per partition, its COPY data cut into segments of at most
    ``SEGMENT_BYTES`` held in memory (never on the executor's disk). A first attempt COPYs each
    segment straight into ``outbox`` under a savepoint (the fast path: no second copy of the
    rows). A ``message_id`` already there fails that COPY; the segment is rolled back to its
    savepoint and goes again through a staging table and one ``INSERT … SELECT … ON CONFLICT
    DO NOTHING``, and so do the segments after it (a replay rarely conflicts in one place
    only). Retried tasks take the staging path at once."""

    #: Most COPY data of a partition held at once (the executor's memory; no temporary file).
    SEGMENT_BYTES = 64 * 1024 * 1024
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
        "properties": "json",
        "stream": "text",
        "available_at": "timestamptz",
    }
    REJECT = _REJECT.format("%s")
    RECORD = _RECORD.format("%s")
    PARKED = PARKED + "+00"
    #: Also re-stamps the rows' ``xid`` with this transaction's: a range claim may have passed
    #: them parked, and must meet them again after this commits (app/outbox/ranges.py).
    RELEASE = (
        "UPDATE outbox SET available_at = now(), xid = pg_current_xact_id() "
        "WHERE batch_id = %s AND available_at = %s"
    )
    DISCARD = "DELETE FROM outbox WHERE batch_id = %s AND available_at = %s"
    HOLD = _HOLD.format("%s")
    UNHOLD = _UNHOLD.format("%s")
    DISCARD_HELD = _DISCARD_HELD.format("%s")

    def __init__(self, conninfo: str, *, password: str | None = None) -> None:
        if password is not None:  # a keyword overrides the conninfo's (which has none)
            conninfo = make_conninfo(conninfo, password=password)
        self.conn = psycopg.connect(conninfo, autocommit=True)

    def close(self) -> None:
        self.conn.close()

    def batch_recorded(self, batch: BatchRef) -> bool:
        row = self.conn.execute(
            "SELECT 1 FROM outbox_batches WHERE batch_id = %s", (batch.key,)
        ).fetchone()
        return row is not None

    def wait_for_standbys(self, timeout: float) -> StandbyWait:
        """PostgreSQL: the WAL position past every commit so far (the batch's record, its
        tasks' rows), then the standbys' (:data:`app.outbox.replication.STANDBYS_FLUSHED`)
        until the slowest has passed it, polling every 5-100 ms."""
        started = time.monotonic()
        target, flushed = self.conn.execute(POSITIONS_NOW).fetchone()
        pause = 0.005
        while True:
            waited = time.monotonic() - started
            if flushed is None:
                return StandbyWait(standbys=False, behind=0, waited=waited)
            if flushed < 0:
                return StandbyWait(standbys=True, behind=None, waited=waited)
            if flushed >= target or waited >= timeout:
                return StandbyWait(standbys=True, behind=max(0, target - flushed), waited=waited)
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
            flushed = self.conn.execute(f"SELECT {STANDBYS_FLUSHED}").fetchone()[0]

    def write(
        self,
        *,
        batch: BatchRef,
        layout: Layout,
        chunks: Iterable[Chunk],
        rejects: Sequence[Rejected],
        first_attempt: bool,
        fail_on_conflict: bool,
        quiet: bool = False,
    ) -> Written:
        names = _columns(layout)
        columns = ", ".join(names)
        inserted, direct, staging = 0, first_attempt, False
        conflicts: list[Conflict] = []
        with self.conn.transaction(), self.conn.cursor() as cur:
            if quiet:  # read by the outbox_notify_new trigger (migration 0012)
                cur.execute("SET LOCAL outbox.quiet = 'on'")
            for segment in _segments(_encoded(layout, chunks), self.SEGMENT_BYTES):
                if direct:
                    try:
                        with self.conn.transaction():  # a savepoint: this segment only
                            self._copy(cur, f"outbox ({columns})", iter(segment))
                            inserted += cur.rowcount
                        continue
                    except pg_errors.UniqueViolation:
                        direct = False
                if not staging:
                    self._create_stage(cur, names)
                    staging = True
                count, found = self._stage(cur, names, segment)
                inserted += count
                conflicts += found
            if conflicts and fail_on_conflict:
                raise KeyConflicts(conflicts)  # rolls the partition back
            self._rejects(cur, batch, rejects)
            if conflicts:
                cur.executemany(self.REJECT, _conflict_rejects(batch, conflicts))
        return Written(inserted, tuple(conflicts))

    def _create_stage(self, cur: psycopg.Cursor[Any], names: Sequence[str]) -> None:
        typed = ", ".join(f"{name} {self.TYPES[name]}" for name in names)
        cur.execute("SET LOCAL jit = off")
        cur.execute("SET LOCAL work_mem = '64MB'")  # sort the staged rows in memory
        cur.execute(f"CREATE TEMP TABLE outbox_stage (pos bigserial, {typed}) ON COMMIT DROP")

    def _stage(
        self, cur: psycopg.Cursor[Any], names: Sequence[str], segment: Sequence[Any]
    ) -> tuple[int, tuple[Conflict, ...]]:
        """One segment through the staging table: (rows new to the outbox, conflicts)."""
        columns = ", ".join(names)
        cur.execute("TRUNCATE outbox_stage")
        self._copy(cur, f"outbox_stage ({columns})", iter(segment))
        staged = cur.rowcount
        cur.execute(
            f"INSERT INTO outbox ({columns}) SELECT {columns} FROM outbox_stage "
            "ORDER BY pos ON CONFLICT (message_id) DO NOTHING"
        )
        inserted = cur.rowcount
        return inserted, self._conflicts(cur, names) if inserted < staged else ()

    @staticmethod
    def _conflicts(cur: psycopg.Cursor[Any], names: Sequence[str]) -> tuple[Conflict, ...]:
        """Staged rows whose id the outbox holds with other content. After the insert, so the
        rows this statement inserted compare equal to themselves and a row skipped because
        another transaction inserted its id meanwhile is compared with that row."""
        tests = {
            "sink": "split_part(s.batch_id, ':', 1) IS DISTINCT FROM split_part(o.batch_id, ':', 1)"
        }
        for name in CONTENT:
            if name not in names:
                tests[name] = f"o.{name} IS NOT NULL"
            elif name in ("headers", "properties"):  # json has no equality: compare as jsonb
                tests[name] = f"s.{name}::jsonb IS DISTINCT FROM o.{name}::jsonb"
            else:
                tests[name] = f"s.{name} IS DISTINCT FROM o.{name}"
        differs = ", ".join(f"{test} AS d_{name}" for name, test in tests.items())
        staged = ", ".join(f"s.{n}" for n in names)
        cur.execute(
            f"SELECT o.batch_id AS holder, {differs}, {staged} FROM outbox_stage s "
            f"JOIN outbox o ON o.message_id = s.message_id "
            f"WHERE {' OR '.join(tests.values())} ORDER BY s.pos"
        )
        out = []
        width = 1 + len(tests)
        for row in cur.fetchall():
            message = dict(zip(names, row[width:], strict=True))
            flags = row[1:width]
            what = tuple(n for n, d in zip(tests, flags, strict=True) if d)
            out.append(Conflict(message["message_id"], row[0], what, _message_json(message)))
        return tuple(out)

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

    def record_batch(
        self, *, batch: BatchRef, row_count: int, rejected_count: int, release: bool = False
    ) -> bool:
        with self.conn.transaction(), self.conn.cursor() as cur:
            if release:
                cur.execute(self.RELEASE, (batch.key, self.PARKED))
            cur.execute(self.RECORD, _batch_params(batch, row_count, rejected_count))
            fresh = bool(cur.rowcount == 1)
            cur.execute(self.UNHOLD, (batch.key,))
            return fresh

    def _transaction(self) -> Any:
        return self.conn.transaction()


def _differences(message: dict[str, Any], row: dict[str, Any]) -> tuple[str, ...]:
    """What ``message`` (a row to insert) and ``row`` (the outbox's) differ in."""
    out = ["sink"] if _sink_of(message.get("batch_id")) != _sink_of(row["batch_id"]) else []
    for name in CONTENT:
        mine, theirs = message.get(name), row[name]
        if name in ("headers", "properties"):
            mine, theirs = (json.loads(v) if isinstance(v, str) else v for v in (mine, theirs))
        elif name == "mandatory":
            mine, theirs = (None if v is None else bool(v) for v in (mine, theirs))
        elif name == "body":
            mine, theirs = (None if v is None else bytes(v) for v in (mine, theirs))
        if mine != theirs:
            out.append(name)
    return tuple(out)


def _segments(data: Iterator[Any], limit: int) -> Iterator[list[Any]]:
    """The COPY blocks in runs of about ``limit`` bytes (at least one block each)."""
    segment: list[bytes] = []
    size = 0
    for block in data:
        segment.append(block)
        size += len(block)
        if size >= limit:
            yield segment
            segment, size = [], 0
    if segment:
        yield segment


#: ``PARKED`` as binary ``timestamptz``: microseconds since 2000-01-01 UTC, 8 bytes big-endian.
_PARKED_BINARY = Const((8).to_bytes(4, "big") + (252_455_529_600_000_000).to_bytes(8, "big"))


def _encoded(layout: Layout, chunks: Iterable[Chunk]) -> Iterator[bytes]:
    constants = [
        _PARKED_BINARY if name == "available_at" else Const.of(value)
        for name, value in layout.constant
    ]
    for chunk in chunks:
        if chunk.rows:
            yield encode([*chunk.columns, *constants])


class SqliteStore(Store):
    """WAL mode; each partition is one ``BEGIN IMMEDIATE`` transaction with ``executemany``."""

    BUSY_MS = 120_000
    REJECT = _REJECT.format("?")
    RECORD = _RECORD.format("?")
    PARKED = PARKED
    DISCARD = "DELETE FROM outbox WHERE batch_id = ? AND available_at = ?"
    HOLD = _HOLD.format("?")
    UNHOLD = _UNHOLD.format("?")
    DISCARD_HELD = _DISCARD_HELD.format("?")

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
        fail_on_conflict: bool,
        quiet: bool = False,
    ) -> Written:
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
            conflicts = self._conflicts(columns, params) if inserted < len(params) else ()
            if conflicts and fail_on_conflict:
                raise KeyConflicts(conflicts)  # rolls the partition back
            self.conn.executemany(self.REJECT, [_reject_params(batch, r) for r in rejects])
            self.conn.executemany(self.REJECT, _conflict_rejects(batch, conflicts))
        return Written(inserted, conflicts)

    #: ids per lookup statement (SQLite allows 32,766 parameters)
    LOOKUP = 500

    def _conflicts(
        self, columns: Sequence[str], params: Sequence[tuple[Any, ...]]
    ) -> tuple[Conflict, ...]:
        """Rows whose id the outbox holds with other content (after the insert, in its
        transaction: the rows just inserted compare equal to themselves)."""
        messages = [dict(zip(columns, p, strict=True)) for p in params]
        held: dict[str, dict[str, Any]] = {}
        wanted = ", ".join(("message_id", "batch_id", *CONTENT))
        for start in range(0, len(messages), self.LOOKUP):
            ids = [m["message_id"] for m in messages[start : start + self.LOOKUP]]
            cur = self.conn.execute(
                f"SELECT {wanted} FROM outbox WHERE message_id IN ({', '.join('?' * len(ids))})",
                ids,
            )
            names = [d[0] for d in cur.description]
            held.update((row[0], dict(zip(names, row, strict=True))) for row in cur)
        out = []
        for message in messages:
            row = held.get(message["message_id"])
            if row is None:  # cannot be: the insert put it there or found it
                continue
            what = _differences(message, row)
            if what:
                out.append(
                    Conflict(message["message_id"], row["batch_id"], what, _message_json(message))
                )
        return tuple(out)

    def record_batch(
        self, *, batch: BatchRef, row_count: int, rejected_count: int, release: bool = False
    ) -> bool:
        with self._transaction():
            if release:
                self.conn.execute(
                    "UPDATE outbox SET available_at = CURRENT_TIMESTAMP "
                    "WHERE batch_id = ? AND available_at = ?",
                    (batch.key, PARKED),
                )
            cur = self.conn.execute(self.RECORD, _batch_params(batch, row_count, rejected_count))
            fresh = bool(cur.rowcount == 1)
            self.conn.execute(self.UNHOLD, (batch.key,))
            return fresh

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
