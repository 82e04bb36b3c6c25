"""The outbox database as every client of it sees it: the engine, the clock, one unit of work
(a transaction that several calls, of several clients, join), and the helpers their statements
share. The clients each have a module: :mod:`app.outbox.store` (the publisher's claims and
outcomes), :mod:`app.outbox.registry` (publishers and their leases), :mod:`app.outbox.actions`
(operators' republish and skip) and :mod:`app.outbox.retention` (the purge).

Sync SQLAlchemy Core, so the API, the CLI, the tests and the publisher's DB thread share it.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    Connection,
    Engine,
    Text,
    and_,
    any_,
    bindparam,
    insert,
    literal,
    select,
    text,
    update,
)

from app.outbox.planner import (
    ASYNC_COMMIT,
    ASYNC_COMMIT_BY_ID,
    BY_ID,
    POSITIONS,
    POSITIONS_BY_ID,
    status_by_id,
)
from app.outbox.schema import audit, events, outbox
from app.outbox.shown import kept
from app.outbox.states import Status, check_transition

Clock = Callable[[], dt.datetime]
SQLITE_MAX_IDS = 10_000


@dataclass(frozen=True, slots=True)
class WalPositions:
    """PostgreSQL WAL byte positions: ``flushed`` is on disk; ``end`` lies past the commit of
    every transaction that had committed when it was read; ``standbys``: on the disk of every
    streaming standby (None: there is none; -1: one whose position this role may not read)."""

    flushed: int
    end: int
    standbys: int | None = None

    @property
    def durable(self) -> int | None:
        """How far the WAL survives a crash and a failover alike (None: not known)."""
        if self.standbys is None:
            return self.flushed
        if self.standbys < 0:
            return None
        return min(self.flushed, self.standbys)


def storable(text: str) -> str:
    """``text`` as every database here can keep it: PostgreSQL's text refuses NUL (U+0000),
    which a broker's reply text (a ``basic.return``, a channel close) may carry, and one such
    text failed the whole write-back it was in, again at every retry. NUL becomes U+FFFD."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class OutboxError(Exception):
    """Base of the outbox clients' own errors."""


class OutboxDatabase:
    """One outbox database: its engine, clock and units of work. Cheap; the clients
    (``PublisherStore(db)``, ``PublisherRegistry(db)``, ...) that share one share its units of
    work: a call of each inside one ``unit_of_work()`` is one transaction."""

    def __init__(self, engine: Engine, *, clock: Clock = utcnow) -> None:
        self.engine = engine
        self.clock = clock
        self.dialect = engine.dialect.name
        self._local = threading.local()

    @classmethod
    def of(cls, source: OutboxDatabase | Engine) -> OutboxDatabase:
        """``source`` itself, or a database on that engine (what each client's constructor
        takes)."""
        return source if isinstance(source, OutboxDatabase) else cls(source)

    @contextmanager
    def unit_of_work(
        self, *, durable: bool = True, by_id: bool = False, positions: bool = False
    ) -> Iterator[None]:
        """Run the calls inside in one transaction (one commit): a publisher writes all the
        outcomes of one flush this way. Nested units join the outer one.

        ``durable=False``: the commit returns before its WAL reaches the disk (PostgreSQL
        ``synchronous_commit = off`` for this transaction; SQLite ``synchronous = NORMAL`` in
        WAL mode, for it alone). A database crash may undo it whole, never tear it: only for
        writes whose loss re-publishes rather than loses (the publisher's outcomes,
        docs/guarantees.md section 1).

        ``by_id=True``: every statement inside finds its rows by id (:meth:`by_id`); on
        PostgreSQL its settings go with the commit's in one round trip.

        ``positions=True`` (PostgreSQL; implied by ``durable=False``): the first statement reads
        the WAL positions too (:meth:`wal_positions`): a durable commit may still be missing
        on a standby that a failover promotes."""
        if getattr(self._local, "conn", None) is not None:
            yield
            return
        committed: list[Callable[[], None]] = []
        undo: list[Callable[[], None]] = []
        sqlite_relaxed = not durable and not self.is_postgres
        with self.engine.connect() as conn:
            if sqlite_relaxed:  # a connection setting, outside the transaction
                conn.exec_driver_sql("PRAGMA synchronous=NORMAL")
                conn.commit()
            try:
                with _undone_on_failure(undo), conn.begin():
                    if self.is_postgres and (positions or not durable):
                        if durable:
                            first = POSITIONS_BY_ID if by_id else POSITIONS
                        else:
                            first = ASYNC_COMMIT_BY_ID if by_id else ASYNC_COMMIT
                        row = conn.execute(first).one()
                        self._local.wal = WalPositions(
                            flushed=int(row[1]),
                            end=int(row[2]),
                            standbys=None if row[3] is None else int(row[3]),
                        )
                        if by_id:
                            conn.info["by_id"] = conn.get_transaction()
                    elif by_id:
                        self.by_id(conn)
                    self._local.conn = conn
                    self._local.committed = committed
                    self._local.undo = undo
                    try:
                        yield
                    finally:
                        self._local.conn = None
                        self._local.committed = None
                        self._local.undo = None
                for done in committed:
                    done()
            finally:
                if sqlite_relaxed:
                    conn.exec_driver_sql("PRAGMA synchronous=FULL")
                    conn.commit()

    def wal_positions(self) -> WalPositions | None:
        """PostgreSQL: the WAL positions read at the start of this thread's last unit of work
        with ``durable=False`` (None before one, and on SQLite)."""
        return getattr(self._local, "wal", None)

    def on_commit(self, done: Callable[[], None]) -> None:
        """Run ``done`` once the unit of work in progress has committed (at once outside one)."""
        committed = getattr(self._local, "committed", None)
        if committed is None:
            done()
        else:
            committed.append(done)

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if the unit of work in progress rolls back (its commit failing too):
        for state kept in memory beside the rows it wrote. Nothing outside one."""
        pending = getattr(self._local, "undo", None)
        if pending is not None:
            pending.append(undo)

    @contextmanager
    def begin(self, *, by_id: bool = False) -> Iterator[Connection]:
        """The unit of work's connection, or a transaction of its own outside one.
        ``by_id=True``: for statements that find their rows by id (:meth:`by_id`)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            if by_id:
                self.by_id(conn)
            yield conn
            return
        with self.engine.begin() as fresh:
            if by_id:
                self.by_id(fresh)
            yield fresh

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    # ---------------------------------------------------------------- helpers

    def ids_in(self, ids: Sequence[int]) -> ColumnElement[bool]:
        if self.is_postgres:  # one array parameter, whatever the count
            return outbox.c.id == any_(bindparam("ids", list(ids), type_=ARRAY(BigInteger)))
        return outbox.c.id.in_(list(ids))

    def chunks(self, ids: Sequence[int]) -> Iterator[Sequence[int]]:
        step = (len(ids) or 1) if self.is_postgres else SQLITE_MAX_IDS
        for start in range(0, len(ids), step):
            yield ids[start : start + step]

    def by_id(self, conn: Connection) -> None:
        """Before statements that find their rows by id (the write-backs, the lease renewal of
        held rows, the events of rows just moved): their plans look each id up in
        ``outbox_pkey``, whatever the statistics say. PostgreSQL, once per transaction; the
        settings last until its end, so a transaction that sends this sends only such
        statements. Callers ask for it with ``begin(by_id=True)`` (or a unit of work's
        ``by_id=True``); this is for a transaction that learns only on the way. The plan and
        why: :data:`app.outbox.planner.BY_ID_SETTINGS` (tests/integration/test_claim_plan.py)."""
        if not self.is_postgres:
            return
        transaction = conn.get_transaction()
        if transaction is not None and conn.info.get("by_id") is transaction:
            return
        conn.execute(BY_ID)
        conn.info["by_id"] = transaction

    def held(self, owner: str, ids: Sequence[int]) -> ColumnElement[bool]:
        return and_(self.ids_in(ids), status_by_id(Status.IN_FLIGHT), outbox.c.lease_owner == owner)

    def transition(
        self,
        *,
        ids: Sequence[int],
        source: Status,
        target: Status,
        owner: str | None = None,
        values: dict[str, Any] | None = None,
    ) -> int:
        """Move rows ``source -> target`` if the edge is legal (else :class:`IllegalTransition`).

        Only rows now in ``source`` (and, given an owner, leased by it) move; returns how many.
        """
        check_transition(source, target)
        if not ids:
            return 0
        moved = 0
        with self.begin(by_id=True) as conn:
            for chunk in self.chunks(ids):
                cond = and_(self.ids_in(chunk), status_by_id(source))
                if owner is not None:
                    cond = and_(cond, outbox.c.lease_owner == owner)
                stmt = update(outbox).where(cond).values(status=target, **(values or {}))
                moved += conn.execute(stmt).rowcount
        return moved

    def record_events(
        self,
        *,
        kind: str,
        ids: Sequence[int],
        at: dt.datetime,
        where: Sequence[ColumnElement[bool]],
    ) -> None:
        """Append a rare event for each of ``ids`` still matching ``where`` (the rows the
        change just moved), with its attempt, reply code and reason, in the change's
        transaction. The confirm path never calls this."""
        if not ids:
            return
        names = ["outbox_id", "message_id", "at", "kind", "attempt", "reply_code", "detail"]
        with self.begin(by_id=True) as conn:
            for chunk in self.chunks(ids):
                rows = select(
                    outbox.c.id,
                    outbox.c.message_id,
                    literal(at, events.c.at.type),
                    literal(kind, Text),
                    outbox.c.attempts,
                    outbox.c.reply_code,
                    kept(outbox.c.last_error),
                ).where(self.ids_in(chunk), *where)
                conn.execute(insert(events).from_select(names, rows))

    def audit(self, conn: Connection, *, actor: str, action: str, **values: Any) -> int:
        """An operator's action in the audit trail, now, in ``conn``'s transaction: its id."""
        stmt = insert(audit).values(at=self.clock(), actor=actor, action=action, **values)
        return int(conn.execute(stmt.returning(audit.c.id)).scalar_one())

    def notify_new(self, conn: Connection) -> None:
        """Rows became due: wake listening publishers at commit (PostgreSQL; polled otherwise)."""
        if self.is_postgres:
            conn.execute(text("SELECT pg_notify('outbox_new', '')"))


def by_multiplicity(ids: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``ids`` grouped by how often each is named: [(times, ids named that often)]."""
    times: dict[int, int] = {}
    for row_id in ids:
        times[row_id] = times.get(row_id, 0) + 1
    groups: dict[int, list[int]] = {}
    for row_id, n in times.items():
        groups.setdefault(n, []).append(row_id)
    return sorted(groups.items())


@contextmanager
def _undone_on_failure(undo: list[Callable[[], None]]) -> Iterator[None]:
    """Around a unit of work's transaction: on any failure (the commit's too), its undo
    callbacks in reverse order, then the failure."""
    try:
        yield
    except BaseException:
        for step in reversed(undo):
            step()
        raise
