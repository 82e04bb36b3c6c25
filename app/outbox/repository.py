"""The outbox repository: every state change of a row, as one batched statement per call.

Sync SQLAlchemy Core, so the API, the CLI, the tests and the publisher's DB thread share it.
Every publisher-side write is guarded by ``status = 'in_flight' AND lease_owner = :owner``: a
publisher whose lease has expired (and whose rows another publisher may hold now) changes nothing,
and the counts returned tell it so.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
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
    Integer,
    Select,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    column,
    delete,
    exists,
    func,
    insert,
    literal,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError

from app.outbox.queries import scope_conditions
from app.outbox.records import Backoff, ClaimedRow, Published, RetryOutcome, ReturnedRow
from app.outbox.schema import KEY_OPEN, audit, events, held, outbox, publishers
from app.outbox.scope import RepublishFilter as RepublishFilter  # re-exported
from app.outbox.states import TERMINAL_FAILURES, Status, check_transition

Clock = Callable[[], dt.datetime]
SQLITE_MAX_IDS = 10_000
#: The texts an operator gives for the audit trail (who acts, why a row is skipped) are one line
#: without these characters (NUL, which PostgreSQL's text refuses, and the controls that would
#: forge lines in logs and tables), checked alike by the API, the console and the CLI. A regular
#: expression character class, without its brackets.
CONTROL_CHARACTERS = r"\x00-\x1f\x7f"
MAX_ACTOR = 64
MAX_REASON = 1000
#: What an operator's text (an actor name, a reason: kept in the audit trail, logged, shown)
#: may not hold: C0 and C1 controls (``\x85`` split a JSON log line), the line and paragraph
#: separators U+2028/U+2029, and the bidirectional embeddings, overrides and isolates (a reason
#: that reads otherwise than it is stored).
OPERATOR_TEXT_FORBIDDEN = r"\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[{OPERATOR_TEXT_FORBIDDEN}]")


def has_control_characters(text: str) -> bool:
    """An operator text holding a character of :data:`OPERATOR_TEXT_FORBIDDEN`."""
    return _CONTROL.search(text) is not None


def storable(text: str) -> str:
    """``text`` as every database here can keep it: PostgreSQL's text refuses NUL (U+0000),
    which a broker's reply text (a ``basic.return``, a channel close) may carry, and one such
    text failed the whole write-back it was in, again at every retry. NUL becomes U+FFFD."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class RepositoryError(Exception):
    """Base of the repository's own errors."""


class PublisherLocked(RepositoryError):
    """A second publisher tried to start on a SQLite outbox that another live publisher holds."""


#: The unkeyed claim walks ix_outbox_due from the last row it claimed (PostgreSQL), not from
#: the index's first entry: the entries of every row claimed since the last VACUUM stay in the
#: index until it runs, and a walk from the start steps over all of them, a cost that grows with
#: the traffic. Rows that land behind that floor (committed by a transaction older than the
#: floor's row, a held batch released, a claim of another publisher rolled back, a row inserted
#: with an old ``available_at``) wait for the next walk from the start: one every this long.
CLAIM_REWALK = dt.timedelta(seconds=1)

#: Before the unkeyed claim: walk ix_outbox_due in order, never a bitmap scan, a sequential
#: scan or a sort, whatever the statistics say (see ``OutboxRepository.claim``).
_WALK_SETTINGS = (
    "set_config('enable_bitmapscan', 'off', true) || set_config('enable_seqscan', 'off', true)"
    " || set_config('enable_sort', 'off', true)"
)
_WALK_DUE_INDEX = text(f"SELECT {_WALK_SETTINGS}")
#: any row holding its ordering key open: the predicate and the order of ix_outbox_key_open,
#: so it reads the first entry of that (small) index (``LIMIT 1`` alone chose a scan of the
#: whole table, which finds nothing when no row has a key)
_FIRST_OPEN_KEY = f"SELECT ordering_key FROM outbox WHERE {KEY_OPEN} ORDER BY ordering_key LIMIT 1"
_ANY_KEY_OPEN = text(_FIRST_OPEN_KEY)
#: PostgreSQL: the same, and when no key is open (no keyed claim will run), the settings of the
#: unkeyed claim at once: one round trip fewer on every claim of an outbox without open keys.
#: With a key open they stay unset here: the keyed claim keeps the planner's choice.
_ANY_KEY_OPEN_ELSE_WALK = text(
    f"SELECT k.open, CASE WHEN k.open IS NULL THEN {_WALK_SETTINGS} END"
    f" FROM (SELECT ({_FIRST_OPEN_KEY}) AS open OFFSET 0) AS k"  # OFFSET 0: one probe, not two
)

#: The head of every ordering key: its first row still open (not confirmed, not skipped). A
#: loose index scan over ``ix_outbox_key_open``: one probe per open key, however many rows wait
#: behind each head (a hot key with 100,000 waiting rows costs one probe, not 100,000).
# the predicate of ix_outbox_key_open, on alias ``o`` (so the planner uses that index)
_OPEN = KEY_OPEN.replace("ordering_key", "o.ordering_key").replace("status", "o.status")
_KEY_HEADS = (
    text(
        f"""
WITH RECURSIVE keys(k) AS (
    SELECT (SELECT o.ordering_key FROM outbox o WHERE {_OPEN} ORDER BY o.ordering_key LIMIT 1)
    UNION ALL
    SELECT (SELECT o.ordering_key FROM outbox o WHERE o.ordering_key > keys.k AND {_OPEN}
            ORDER BY o.ordering_key LIMIT 1)
    FROM keys WHERE keys.k IS NOT NULL
)
SELECT (SELECT o.id FROM outbox o WHERE o.ordering_key = keys.k AND {_OPEN}
        ORDER BY o.id LIMIT 1) AS id
FROM keys WHERE keys.k IS NOT NULL
"""
    )
    .columns(column("id", BigInteger))
    .subquery("key_heads")
)


@dataclass(frozen=True, slots=True)
class RepublishResult:
    dry_run: bool
    count: int
    matched: int
    sample: list[str]
    audit_id: int | None
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class SkipResult:
    """An operator skipped a terminal failure: it will not be delivered, its key goes on."""

    message_id: str
    previous: Status
    ordering_key: str | None
    released: int  # rows of its key that were waiting behind it
    audit_id: int


class CannotSkip(ValueError):
    """The row does not exist or is not a terminal failure (nothing changed)."""


class RequestIdReused(ValueError):
    """A republish request id already names another action, filter or limit (nothing moved):
    repeating an id replays its first result only when the request is the same."""

    def __init__(self, request_id: str, audit_id: int) -> None:
        super().__init__(
            f"request_id {request_id!r} was already used (audit row {audit_id}) "
            "with a different filter or limit; choose a new request_id"
        )
        self.audit_id = audit_id


PUBLISH_FACTS = ("channel_id", "delivery_tag", "published_at")
SQLITE_TIME = "%Y-%m-%d %H:%M:%S.%f"  # SQLAlchemy's SQLite DATETIME text format


def _sqlite_json(value: Any) -> Any:
    """A value as SQLite stores it, for ``json_each``: datetimes as naive-UTC text."""
    if isinstance(value, dt.datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return aware.astimezone(dt.UTC).strftime(SQLITE_TIME)
    return value


#: The claim reads the JSON columns as text: decoding them here would let one row's content
#: (3,000 levels of nesting, say) fail the whole claim, for every publisher, forever.
CLAIM_COLUMNS = (
    outbox.c.id,
    outbox.c.message_id,
    outbox.c.batch_id,
    outbox.c.exchange,
    outbox.c.routing_key,
    outbox.c.mandatory,
    outbox.c.body,
    outbox.c.content_type,
    cast(outbox.c.headers, Text).label("headers"),
    cast(outbox.c.properties, Text).label("properties"),
    outbox.c.ordering_key,
    outbox.c.attempts,
    outbox.c.max_attempts,
)


#: This transaction's commit does not wait for the disk (the publisher's outcomes only).
_ASYNC_COMMIT = text("SET LOCAL synchronous_commit TO off")


class OutboxRepository:
    """All reads and writes of outbox rows that change their state."""

    def __init__(self, engine: Engine, *, clock: Clock = utcnow) -> None:
        self.engine = engine
        self.clock = clock
        self.dialect = engine.dialect.name
        self._local = threading.local()
        # the claim statements (keyed, from a floor), built once
        self._claims: dict[tuple[bool, bool], Any] = {}
        #: the unkeyed claim's floor: (available_at, id) of the last row it took, and when it
        #: last walked from the start (PostgreSQL; see CLAIM_REWALK)
        self._floor: tuple[dt.datetime, int] | None = None
        self._walked_at: dt.datetime | None = None
        #: rows this repository put back to pending may sit behind the floor (their
        #: ``available_at`` is now, which can equal the floor's): the next claim walks from
        #: the start. Set once their transaction committed, so that walk sees them.
        self._rewalk = False
        self._updates: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}  # write-backs

    @contextmanager
    def unit_of_work(self, *, durable: bool = True) -> Iterator[None]:
        """Run the calls inside in one transaction (one commit): a publisher writes all the
        outcomes of one flush this way. Nested units join the outer one.

        ``durable=False``: the commit returns before its WAL reaches the disk (PostgreSQL
        ``synchronous_commit = off`` for this transaction; SQLite ``synchronous = NORMAL`` in
        WAL mode, for it alone). A database crash may undo it whole, never tear it: only for
        writes whose loss re-publishes rather than loses (the publisher's outcomes,
        docs/guarantees.md section 1)."""
        if getattr(self._local, "conn", None) is not None:
            yield
            return
        committed: list[Callable[[], None]] = []
        sqlite_relaxed = not durable and not self.is_postgres
        with self.engine.connect() as conn:
            if sqlite_relaxed:  # a connection setting, outside the transaction
                conn.exec_driver_sql("PRAGMA synchronous=NORMAL")
                conn.commit()
            try:
                with conn.begin():
                    if not durable and self.is_postgres:
                        conn.execute(_ASYNC_COMMIT)
                    self._local.conn = conn
                    self._local.committed = committed
                    try:
                        yield
                    finally:
                        self._local.conn = None
                        self._local.committed = None
                for done in committed:
                    done()
            finally:
                if sqlite_relaxed:
                    conn.exec_driver_sql("PRAGMA synchronous=FULL")
                    conn.commit()

    def _on_commit(self, done: Callable[[], None]) -> None:
        """Run ``done`` once the unit of work in progress has committed (at once outside one)."""
        committed = getattr(self._local, "committed", None)
        if committed is None:
            done()
        else:
            committed.append(done)

    def _walk_from_start(self) -> None:
        self._rewalk = True

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            yield conn
            return
        with self.engine.begin() as fresh:
            yield fresh

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    # ---------------------------------------------------------------- helpers

    def _ids_in(self, ids: Sequence[int]) -> ColumnElement[bool]:
        if self.is_postgres:  # one array parameter, whatever the count
            return outbox.c.id == any_(bindparam("ids", list(ids), type_=ARRAY(BigInteger)))
        return outbox.c.id.in_(list(ids))

    def _chunks(self, ids: Sequence[int]) -> Iterator[Sequence[int]]:
        step = (len(ids) or 1) if self.is_postgres else SQLITE_MAX_IDS
        for start in range(0, len(ids), step):
            yield ids[start : start + step]

    def _held(self, owner: str, ids: Sequence[int]) -> ColumnElement[bool]:
        return and_(
            self._ids_in(ids), outbox.c.status == Status.IN_FLIGHT, outbox.c.lease_owner == owner
        )

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
        with self._begin() as conn:
            for chunk in self._chunks(ids):
                cond = and_(self._ids_in(chunk), outbox.c.status == source)
                if owner is not None:
                    cond = and_(cond, outbox.c.lease_owner == owner)
                stmt = update(outbox).where(cond).values(status=target, **(values or {}))
                moved += conn.execute(stmt).rowcount
        return moved

    # ------------------------------------------------------- publisher registry

    def register_publisher(self, *, publisher_id: str, stale_after: float) -> dict[str, Any] | None:
        """Record this publisher; return the last stats of an earlier run with the same id (its
        counters continue from them). On SQLite, refuse when another live publisher holds the
        outbox."""
        now = self.clock()
        row = {
            "publisher_id": publisher_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": now,
            "heartbeat_at": now,
            "stopped_at": None,
        }
        with self._begin() as conn:
            before = conn.execute(
                select(publishers.c.stats).where(publishers.c.publisher_id == publisher_id)
            ).scalar()
            if not self.is_postgres:
                self._register_sole(conn, row, cutoff=now - dt.timedelta(seconds=stale_after))
            else:
                conn.execute(delete(publishers).where(publishers.c.publisher_id == publisher_id))
                conn.execute(insert(publishers).values(**row))
        return before if isinstance(before, dict) else None

    def _register_sole(self, conn: Connection, row: dict[str, Any], *, cutoff: dt.datetime) -> None:
        me = row["publisher_id"]
        others = select(publishers).where(
            publishers.c.publisher_id != me,
            publishers.c.stopped_at.is_(None),
            publishers.c.heartbeat_at > cutoff,
        )
        # One statement: SQLite takes its write lock for it, so two starters cannot both pass.
        conn.execute(delete(publishers).where(publishers.c.publisher_id == me, ~exists(others)))
        cols = list(row)
        values = select(*[literal(row[c], type_=publishers.c[c].type) for c in cols])
        inserted = conn.execute(
            insert(publishers).from_select(cols, values.where(~exists(others)))
        ).rowcount
        if inserted:
            return
        holder = conn.execute(others.limit(1)).mappings().first()
        assert holder is not None
        raise PublisherLocked(
            f"another publisher {holder['publisher_id']!r} (pid {holder['pid']} on "
            f"{holder['hostname']}) holds this SQLite outbox; "
            "SQLite allows one publisher at a time: "
            "stop it, or move the outbox to PostgreSQL to run several"
        )

    def heartbeat(
        self,
        *,
        publisher_id: str,
        lease_seconds: float,
        stats: dict[str, Any] | None = None,
        held: Sequence[int] | None = None,
    ) -> int:
        """Refresh this publisher's heartbeat (and its counters, for the API's /metrics) and
        extend the leases of its rows. Returns how many leases were extended.

        ``held``: extend only these rows, the ones the process knows it holds. A row leased to
        this owner but unknown to the process (its claim's reply was lost) then expires and comes
        back through :meth:`release_expired` instead of being renewed forever.
        """
        now = self.clock()
        beat: dict[str, Any] = {"heartbeat_at": now, "stopped_at": None}
        if stats is not None:
            beat["stats"] = stats
        with self._begin() as conn:
            conn.execute(
                update(publishers).where(publishers.c.publisher_id == publisher_id).values(**beat)
            )
            if held is not None and not held:
                return 0
            mine = and_(outbox.c.status == Status.IN_FLIGHT, outbox.c.lease_owner == publisher_id)
            renew = update(outbox).values(lease_until=now + dt.timedelta(seconds=lease_seconds))
            if held is None:
                return conn.execute(renew.where(mine)).rowcount
            return sum(
                conn.execute(renew.where(mine, self._ids_in(chunk))).rowcount
                for chunk in self._chunks(held)
            )

    def leased_ids(self, *, owner: str) -> list[int]:
        """Ids of the ``in_flight`` rows leased to ``owner`` (to find rows a lost reply hid)."""
        stmt = select(outbox.c.id).where(
            outbox.c.status == Status.IN_FLIGHT, outbox.c.lease_owner == owner
        )
        with self._begin() as conn:
            return list(conn.scalars(stmt))

    def unregister_publisher(
        self, *, publisher_id: str, stats: dict[str, Any] | None = None
    ) -> None:
        values: dict[str, Any] = {"stopped_at": self.clock()}
        if stats is not None:
            values["stats"] = stats
        with self._begin() as conn:
            conn.execute(
                update(publishers).where(publishers.c.publisher_id == publisher_id).values(**values)
            )

    # ---------------------------------------------------------------- hot path

    def _due(
        self, now: Any, limit: Any, *, keyed: bool, floor: tuple[Any, Any] | None = None
    ) -> Select[tuple[int]]:
        """Due pending rows, oldest first: rows without an ordering key, or (``keyed``) only the
        head of each ordering key, the first of its rows not yet confirmed or skipped. Never a
        row of a held batch (``outbox_held``: a Spark batch written but not yet recorded); a
        held head holds its key back. ``floor``: only rows at or after this ``(available_at,
        id)``, in the index's order (a range condition on ix_outbox_due)."""
        due = (
            select(outbox.c.id)
            .where(outbox.c.status == self._pending(keyed), outbox.c.available_at <= now)
            # NOT IN, not NOT EXISTS: PostgreSQL cannot turn it into an anti-join, so the plan
            # stays the walk of ix_outbox_due with the (few) held batch ids hashed once per
            # statement, whatever it guesses about outbox_held (never analysed, it guessed 1,200
            # rows and chose a hash anti-join over a scan of the whole outbox on every claim)
            .where(outbox.c.batch_id.not_in(select(held.c.batch_id)))
            .order_by(outbox.c.available_at, outbox.c.id)
            .limit(limit)
        )
        if keyed:
            due = due.where(outbox.c.id.in_(select(_KEY_HEADS.c.id)))
        else:
            due = due.where(outbox.c.ordering_key.is_(None))
        if floor is not None:
            due = due.where(tuple_(outbox.c.available_at, outbox.c.id) >= tuple_(*floor))
        return due.with_for_update(skip_locked=True) if self.is_postgres else due

    @staticmethod
    def _pending(keyed: bool) -> Any:
        """'pending' for the claim's status test. Unkeyed: written into the statement, so a
        prepared claim's generic plan (psycopg prepares it on its fifth run; PostgreSQL may keep
        that plan until the next ANALYZE) can prove ix_outbox_due's predicate and walk it.
        Keyed: bound. Written in, it let the keyed claim's generic plan walk ix_outbox_due and
        join every row to the materialised key heads (a comparison per due row and key head);
        bound, the plan starts from the key heads."""
        if keyed:
            return Status.PENDING
        return literal(Status.PENDING.value, literal_execute=True)

    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedRow]:
        """Take up to ``limit`` due rows, oldest first, into ``in_flight`` under a lease.

        PostgreSQL: ``FOR UPDATE SKIP LOCKED`` in a CTE, so concurrent claimers never share a row.
        SQLite: one statement under SQLite's single-writer lock (and one publisher at a time).

        Rows with an ordering key are claimed only as their key's head: no earlier row of the
        key is still open (pending, in flight, or a terminal failure that parks the key). So at
        most one row per key is ever in flight, whichever publisher holds it, and a row is first
        published only after every earlier row of its key was confirmed (or skipped). A head
        that another claimer has just taken is seen as in flight once its lock is released
        (PostgreSQL re-checks ``status`` of a row it had to wait for), never claimed twice.
        """
        check_transition(Status.PENDING, Status.IN_FLIGHT)
        now = self.clock()
        params = {
            "claim_now": now,
            "claim_owner": owner,
            "claim_until": now + dt.timedelta(seconds=lease_seconds),
        }
        rows: list[Any] = []
        walking = False  # the unkeyed claim's settings are made
        with self._begin() as conn:
            for keyed in (True, False):
                left = limit - len(rows)
                if left <= 0:
                    break
                if keyed and not self._any_key_open(conn):
                    # No open keyed row (a tiny partial index says so): skip the keyed claim.
                    # Without keys PostgreSQL's plan for it, once ANALYZE has seen the outbox,
                    # walked every due row looking for a key head.
                    walking = self.is_postgres
                    continue
                if not keyed and self.is_postgres and not walking:
                    # This claim must walk ix_outbox_due in order and stop after ``left`` rows.
                    # An outbox's statistics always lag its content (a queue: every row passes
                    # through in seconds). With a backlog written since the last ANALYZE,
                    # PostgreSQL guessed few due rows and chose a bitmap scan of every due row
                    # and a sort; the prepared claim's generic plan (kept once chosen, until the
                    # next ANALYZE) was a sequential scan of the whole table and a sort. Both
                    # cost in proportion to the backlog, on every claim. With 'pending' written
                    # into the statement (``_due``) and these settings, the walk of the index
                    # is the only plan without a penalty, custom or generic
                    # (tests/integration/test_claim_plan.py). The keyed claim before it keeps
                    # the planner's choice.
                    conn.execute(_WALK_DUE_INDEX)
                if not keyed and self.is_postgres:
                    rows += self._claim_from_floor(conn, {**params, "claim_limit": left}, now)
                    continue
                stmt = self._claim_statement(keyed)
                rows += conn.execute(stmt, {**params, "claim_limit": left}).all()
        claimed = [ClaimedRow._make(row) for row in rows]
        claimed.sort(key=lambda r: r.id)
        return claimed

    def _any_key_open(self, conn: Connection) -> bool:
        """Whether a row holds its ordering key open. PostgreSQL: when none does, the same
        round trip makes the unkeyed claim's settings (``_ANY_KEY_OPEN_ELSE_WALK``)."""
        if not self.is_postgres:
            return conn.execute(_ANY_KEY_OPEN).first() is not None
        return conn.execute(_ANY_KEY_OPEN_ELSE_WALK).scalar() is not None

    def _claim_from_floor(
        self, conn: Connection, params: dict[str, Any], now: dt.datetime
    ) -> list[Any]:
        """The unkeyed claim on PostgreSQL: from the floor, or from the start once per
        :data:`CLAIM_REWALK` (and when there is no floor yet); the floor moves to the last row
        taken. Rows come back with their ``available_at`` last, which is cut off here."""
        floor, walked = self._floor, self._walked_at
        floored = floor is not None and walked is not None and now - walked < CLAIM_REWALK
        if self._rewalk:
            self._rewalk = floored = False
        if floored:
            assert floor is not None
            params = {**params, "floor_at": floor[0], "floor_id": floor[1]}
        else:
            self._walked_at = now
        got = conn.execute(self._claim_statement(False, floored=floored), params).all()
        if got:
            # the walk took every row it could up to this one (it skipped only rows locked by
            # another claim or in a held batch): the next walk goes on from here
            self._floor = max((row[-1], row[0]) for row in got)
        return [row[:-1] for row in got]

    def _claim_statement(self, keyed: bool, *, floored: bool = False) -> Any:
        """The claim, built once per repository and kind, its values bound: building it and
        its cache key for every claim is Python work on the claim's path. The unkeyed claim on
        PostgreSQL also returns each row's ``available_at`` (for the floor)."""
        stmt = self._claims.get((keyed, floored))
        if stmt is not None:
            return stmt
        now = bindparam("claim_now", type_=outbox.c.available_at.type)
        floor = None
        if floored:
            floor = (
                bindparam("floor_at", type_=outbox.c.available_at.type),
                bindparam("floor_id", type_=BigInteger),
            )
        due = self._due(now, bindparam("claim_limit", type_=Integer), keyed=keyed, floor=floor)
        if self.is_postgres:
            cte = due.cte("due")
            stmt = update(outbox).where(outbox.c.id == cte.c.id)
        else:
            stmt = update(outbox).where(outbox.c.id.in_(due.scalar_subquery()))
        stmt = stmt.values(
            status=Status.IN_FLIGHT,
            lease_owner=bindparam("claim_owner", type_=outbox.c.lease_owner.type),
            lease_until=bindparam("claim_until", type_=outbox.c.lease_until.type),
            attempts=outbox.c.attempts + 1,
            channel_id=None,
            delivery_tag=None,
            claimed_at=now,
        )
        extra = (outbox.c.available_at,) if self.is_postgres and not keyed else ()
        stmt = stmt.returning(*CLAIM_COLUMNS, *extra)
        self._claims[(keyed, floored)] = stmt
        return stmt

    # -------------------------------------------- per-row values, one statement

    def _update_rows(
        self,
        owner: str,
        rows: Sequence[Sequence[Any]],
        columns: Sequence[str],
        values: dict[str, Any],
    ) -> int:
        """``UPDATE outbox SET <columns> = per-row values, <values> WHERE held by owner`` for
        ``rows`` of ``(id, *column values)``, as ONE statement: ``FROM unnest(arrays)`` on
        PostgreSQL, ``FROM json_each(:rows)`` on SQLite. Returns the rows updated.

        ``values`` are plain values, bound: the statement is built once per repository and
        shape (columns and value names). Building it and its cache key cost about 0.3 ms of
        Python on every write-back."""
        if not rows:
            return 0
        stmt = self._update_statement(tuple(columns), tuple(values))
        params: dict[str, Any] = {"u_owner": owner}
        params.update((f"v_{name}", value) for name, value in values.items())
        if self.is_postgres:
            for i, name in enumerate(["id", *columns]):
                params[f"u_{name}"] = [r[i] for r in rows]
        else:
            params["u_rows"] = json.dumps([[_sqlite_json(x) for x in r] for r in rows])
        with self._begin() as conn:
            return conn.execute(stmt, params).rowcount

    def _update_statement(self, columns: tuple[str, ...], names: tuple[str, ...]) -> Any:
        key = (columns, names)
        stmt = self._updates.get(key)
        if stmt is not None:
            return stmt
        v = self._pg_rows(columns) if self.is_postgres else self._sqlite_rows(columns)
        owner = bindparam("u_owner", type_=outbox.c.lease_owner.type)
        bound = {name: bindparam(f"v_{name}", type_=outbox.c[name].type) for name in names}
        stmt = (
            update(outbox)
            .where(
                outbox.c.id == v.c.id,
                outbox.c.status == Status.IN_FLIGHT,
                outbox.c.lease_owner == owner,
            )
            .values(**{c: v.c[c] for c in columns}, **bound)
        )
        self._updates[key] = stmt
        return stmt

    @staticmethod
    def _pg_rows(columns: Sequence[str]) -> Any:
        names = ["id", *columns]
        return select(
            *[
                func.unnest(bindparam(f"u_{name}", type_=ARRAY(outbox.c[name].type))).label(name)
                for name in names
            ]
        ).subquery("v")

    @staticmethod
    def _sqlite_rows(columns: Sequence[str]) -> Any:
        each = func.json_each(bindparam("u_rows", type_=Text)).table_valued("value").alias("j")
        names = ["id", *columns]
        return select(
            *[func.json_extract(each.c.value, f"$[{i}]").label(n) for i, n in enumerate(names)]
        ).subquery("v")

    # ---------------------------------------------------------------- outcomes

    def record_published(
        self,
        *,
        owner: str,
        channel_id: int,
        tags: Sequence[tuple[int, int]],
        published_at: dt.datetime | None = None,
    ) -> int:
        """Note on each held row the channel and delivery tag it was published with, and when
        (``published_at``, default now)."""
        values = {"channel_id": channel_id, "published_at": published_at or self.clock()}
        return self._update_rows(owner, tags, ["delivery_tag"], values)

    def mark_confirmed(
        self, *, owner: str, ids: Sequence[int] = (), published: Sequence[Published] = ()
    ) -> int:
        """Broker acked (and did not return) these publishes.

        Rows given in ``published`` also get their channel, delivery tag and publish time in the
        same statement (one row version: no separate "published" write per row).
        """
        values = {
            "status": Status.CONFIRMED,
            "confirmed_at": self.clock(),
            "lease_owner": None,
            "lease_until": None,
            "last_error": None,
        }
        check_transition(Status.IN_FLIGHT, Status.CONFIRMED)
        with self.unit_of_work():
            return self._confirm(owner, ids, published, values)

    def _confirm(
        self,
        owner: str,
        ids: Sequence[int],
        published: Sequence[Published],
        values: dict[str, Any],
    ) -> int:
        moved = 0
        if ids:
            values_no_status = {k: v for k, v in values.items() if k != "status"}
            moved += self.transition(
                ids=ids,
                source=Status.IN_FLIGHT,
                target=Status.CONFIRMED,
                owner=owner,
                values=values_no_status,
            )
        if published:  # each a tuple (id, *PUBLISH_FACTS)
            moved += self._update_rows(owner, published, PUBLISH_FACTS, values)
        return moved

    def mark_returned(
        self, *, owner: str, returns: Sequence[ReturnedRow], published: Sequence[Published] = ()
    ) -> int:
        """Broker returned these mandatory publishes as unroutable (``basic.return``); rows in
        ``published`` also get their channel, tag and publish time, in the same statement."""
        check_transition(Status.IN_FLIGHT, Status.RETURNED)
        facts = {p.id: (p.channel_id, p.delivery_tag, p.published_at) for p in published}
        now = self.clock()
        values = {
            "status": Status.RETURNED,
            "confirmed_at": now,
            "lease_owner": None,
            "lease_until": None,
        }
        reply = ["reply_code", "reply_text", "last_error"]
        with_facts, without = [], []
        for r in returns:
            text = storable(r.reply_text)
            row = (r.id, r.reply_code, text, f"returned by broker: {r.reply_code} {text}")
            if r.id in facts:
                with_facts.append((*row, *facts[r.id]))
            else:
                without.append(row)
        with self.unit_of_work():
            moved = self._update_rows(owner, with_facts, [*reply, *PUBLISH_FACTS], values) + (
                self._update_rows(owner, without, reply, values)
            )
            self._record(
                kind="returned",
                ids=[r.id for r in returns],
                at=now,
                where=[outbox.c.status == Status.RETURNED, outbox.c.confirmed_at == now],
            )
            return moved

    def mark_failed(self, *, owner: str, ids: Sequence[int], reason: str) -> int:
        """A permanent error (oversized body, destination gone past its budget): keep the reason."""
        values = {"last_error": storable(reason), "lease_owner": None, "lease_until": None}
        with self.unit_of_work():
            moved = self.transition(
                ids=ids, source=Status.IN_FLIGHT, target=Status.FAILED, owner=owner, values=values
            )
            self._record(
                kind="failed",
                ids=ids,
                at=self.clock(),
                where=[
                    outbox.c.status == Status.FAILED,
                    outbox.c.last_error == values["last_error"],
                ],
            )
            return moved

    def retry(
        self,
        *,
        owner: str,
        ids: Sequence[int],
        error: str,
        backoff: Backoff,
        exhausted: Status,
        max_attempts: int | None = None,
        nack: bool = False,
    ) -> RetryOutcome:
        """Back to ``pending`` after a jittered backoff, or to ``exhausted`` once the budget is
        spent.

        ``nack``: the broker nacked the rows; each row's ``nacks`` goes up and is the budget
        spent (``nacks >= max_attempts``): lost confirms, counted in ``attempts``, never end a
        row. Otherwise (destination errors) the budget is ``attempts`` against ``max_attempts``
        when given, else each row's own.
        """
        check_transition(Status.IN_FLIGHT, exhausted)
        if not ids:
            return RetryOutcome(0, 0)
        error = storable(error)
        now = self.clock()
        held = select(outbox.c.id, outbox.c.attempts, outbox.c.max_attempts, outbox.c.nacks).where(
            self._held(owner, ids)
        )
        if self.is_postgres:
            held = held.with_for_update()
        with self.unit_of_work(), self._begin() as conn:  # one transaction: rows stay locked
            rows = conn.execute(held).all()
            spent_rows = [r for r in rows if _spent(r, max_attempts=max_attempts, nack=nack)]
            spent = [r.id for r in spent_rows]
            again = [r for r in rows if r not in spent_rows]
            if spent:
                values: dict[str, Any] = {
                    "status": exhausted,
                    "last_error": error,
                    "lease_owner": None,
                    "lease_until": None,
                }
                if nack:
                    values["nacks"] = outbox.c.nacks + 1
                conn.execute(update(outbox).where(self._held(owner, spent)).values(**values))
            if again:
                self._reschedule(owner, again, now=now, error=error, backoff=backoff, nack=nack)
            self._record(
                kind=exhausted.value, ids=spent, at=now, where=[outbox.c.status == exhausted]
            )
            self._record(
                kind="retry",
                ids=[r.id for r in again],
                at=now,
                where=[outbox.c.status == Status.PENDING],
            )
        return RetryOutcome(retried=len(again), exhausted=len(spent))

    def _reschedule(
        self,
        owner: str,
        rows: Sequence[Any],
        *,
        now: dt.datetime,
        error: str,
        backoff: Backoff,
        nack: bool = False,
    ) -> None:
        values = {
            "status": Status.PENDING,
            "last_error": error,
            "lease_owner": None,
            "lease_until": None,
        }
        if nack:  # the backoff grows with the nacks, not with lost confirms
            due = [
                (r.id, now + dt.timedelta(seconds=backoff.delay(r.nacks + 1)), r.nacks + 1)
                for r in rows
            ]
            self._update_rows(owner, due, ["available_at", "nacks"], values)
            return
        plain = [(r.id, now + dt.timedelta(seconds=backoff.delay(r.attempts))) for r in rows]
        self._update_rows(owner, plain, ["available_at"], values)

    def postpone(self, *, owner: str, ids: Sequence[int], error: str, delay: float) -> int:
        """Held rows back to ``pending``, due in ``delay`` seconds, with no budget spent: their
        destination is out (it nacks everything), not the rows at fault."""
        if not ids:
            return 0
        values = {
            "status": Status.PENDING,
            "last_error": storable(error),
            "lease_owner": None,
            "lease_until": None,
            "available_at": self.clock() + dt.timedelta(seconds=delay),
        }
        with self._begin() as conn:
            return conn.execute(
                update(outbox).where(self._held(owner, ids)).values(**values)
            ).rowcount

    def release(
        self, *, owner: str, ids: Sequence[int], lost: bool, error: str | None = None
    ) -> int:
        """Give held rows back to ``pending``, due now.

        ``lost=True``: they were published but their confirm will never come (channel or
        connection gone), so the next publish may be a duplicate: count it in ``lost_confirms``.
        """
        values: dict[str, Any] = {
            "available_at": self.clock(),
            "lease_owner": None,
            "lease_until": None,
            "lost_confirms": outbox.c.lost_confirms + (1 if lost else 0),
        }
        if error is not None:
            values["last_error"] = storable(error)
        with self.unit_of_work():
            moved = self.transition(
                ids=ids,
                source=Status.IN_FLIGHT,
                target=Status.PENDING,
                owner=owner,
                values=values,
            )
            if lost:
                self._record(
                    kind="lost",
                    ids=ids,
                    at=values["available_at"],
                    where=[
                        outbox.c.status == Status.PENDING,
                        outbox.c.available_at == values["available_at"],
                    ],
                )
            if moved:
                self._on_commit(self._walk_from_start)
            return moved

    def _record(
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
        with self._begin() as conn:
            for chunk in self._chunks(ids):
                rows = select(
                    outbox.c.id,
                    outbox.c.message_id,
                    literal(at, events.c.at.type),
                    literal(kind, Text),
                    outbox.c.attempts,
                    outbox.c.reply_code,
                    outbox.c.last_error,
                ).where(self._ids_in(chunk), *where)
                conn.execute(insert(events).from_select(names, rows))

    def resend(self, *, owner: str, ids: Sequence[int], error: str) -> int:
        """Held rows published again without a new claim (a quarantine's isolated publish): a
        new attempt, and the earlier publish counts as a possible duplicate. They stay
        ``in_flight`` with this owner."""
        values = {
            "attempts": outbox.c.attempts + 1,
            "lost_confirms": outbox.c.lost_confirms + 1,
            "last_error": storable(error),
            "channel_id": None,
            "delivery_tag": None,
        }
        with self._begin() as conn:
            return sum(
                conn.execute(
                    update(outbox).where(self._held(owner, chunk)).values(**values)
                ).rowcount
                for chunk in self._chunks(ids)
            )

    def release_expired(self) -> int:
        """Rows of a publisher that died (lease expired) go back to ``pending``.

        Each counts a lost confirm: the publisher records delivery tags lazily (batched with the
        outcomes), so a row without a tag may still have been on the wire. ``lost_confirms`` is
        therefore an upper bound of the duplicates, never an undercount.
        """
        now = self.clock()
        expired = (outbox.c.status == Status.IN_FLIGHT, outbox.c.lease_until < now)
        where: Any = expired
        if self.is_postgres:
            # step past rows a live (or frozen) publisher has locked: one UPDATE over all of
            # them waited on a frozen publisher's retry() for as long as it stayed frozen, and
            # a dead publisher's rows waited with it
            pick = select(outbox.c.id).where(*expired).with_for_update(skip_locked=True)
            where = (outbox.c.id.in_(pick.scalar_subquery()),)
        stmt = (
            update(outbox)
            .where(*where)
            .values(
                status=Status.PENDING,
                available_at=now,
                lease_owner=None,
                lease_until=None,
                lost_confirms=outbox.c.lost_confirms + 1,
                last_error="lease expired: publisher stopped without settling",
            )
        )
        with self._begin() as conn:
            moved = int(conn.execute(stmt).rowcount)
        if moved:
            self._on_commit(self._walk_from_start)
        return moved

    def count_open(self) -> int:
        """Rows not settled yet (``pending`` or ``in_flight``): zero means the outbox is drained."""
        stmt = select(func.count()).where(
            outbox.c.status.in_([Status.PENDING.value, Status.IN_FLIGHT.value])
        )
        with self._begin() as conn:
            return int(conn.execute(stmt).scalar_one())

    # ------------------------------------------------------------ operator side

    def republish(
        self,
        *,
        actor: str,
        filter: RepublishFilter,
        limit: int,
        dry_run: bool,
        request_id: str | None = None,
        principal: str | None = None,
        client_addr: str | None = None,
    ) -> RepublishResult:
        """Move terminal-failure rows matching ``filter`` back to ``pending``, with an audit row.

        ``dry_run`` counts and samples, changes nothing. A ``request_id`` seen before returns that
        run's result again and moves nothing (safe to retry an operator call) when the filter and
        the limit are the same, and raises :class:`RequestIdReused` otherwise (a dry run too).
        The id is read in the transaction that moves the rows, and its audit row is written
        there under a unique constraint: of two concurrent calls with one id, the loser's moves
        are rolled back and it is compared with the winner's row, never answered its result.
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        try:
            return self._republish(
                actor=actor,
                flt=filter,
                limit=limit,
                dry_run=dry_run,
                request_id=request_id,
                who=(principal, client_addr),
            )
        except IntegrityError:  # a concurrent call with the same request id won the race
            if request_id is None:
                raise
            with self.engine.connect() as conn:
                previous = self._replay(conn, request_id, flt=filter, limit=limit)
            if previous is None:
                raise
            return previous

    def _replay(
        self, conn: Connection, request_id: str, *, flt: RepublishFilter, limit: int
    ) -> RepublishResult | None:
        """The first result of ``request_id`` when this request is the same; None if unused."""
        stmt = select(audit.c.id, audit.c.action, audit.c.filter, audit.c.result)
        row = conn.execute(stmt.where(audit.c.request_id == request_id)).first()
        if row is None:
            return None
        res = row.result or {}
        same_limit = res.get("limit", limit) == limit  # rows from before the limit was kept
        if row.action != "republish" or row.filter != flt.as_json() or not same_limit:
            raise RequestIdReused(request_id, int(row.id))
        return RepublishResult(
            dry_run=False,
            count=res.get("count", 0),
            matched=res.get("matched", 0),
            sample=res.get("sample", []),
            audit_id=row.id,
            replayed=True,
        )

    def _filter_cond(self, flt: RepublishFilter) -> ColumnElement[bool]:
        return and_(*scope_conditions(flt))

    def _republish(
        self,
        *,
        actor: str,
        flt: RepublishFilter,
        limit: int,
        dry_run: bool,
        request_id: str | None,
        who: tuple[str | None, str | None] = (None, None),
    ) -> RepublishResult:
        cond = self._filter_cond(flt)
        pick = select(
            outbox.c.id,
            outbox.c.message_id,
            outbox.c.status,
            outbox.c.attempts,
            outbox.c.reply_code,
            outbox.c.last_error,
            outbox.c.reply_text,
        ).where(cond)
        pick = pick.order_by(outbox.c.id).limit(limit)
        if self.is_postgres and not dry_run:
            pick = pick.with_for_update(skip_locked=True)
        with self._begin() as conn:
            previous = (
                None if request_id is None else self._replay(conn, request_id, flt=flt, limit=limit)
            )
            if previous is not None and not dry_run:
                return previous
            matched = int(conn.execute(select(func.count()).where(cond)).scalar_one())
            rows = conn.execute(pick).all()
            sample = [r.message_id for r in rows[:20]]
            if dry_run:
                return RepublishResult(
                    dry_run=True, count=len(rows), matched=matched, sample=sample, audit_id=None
                )
            for status in {Status(r.status) for r in rows}:
                check_transition(status, Status.PENDING)
            ids = [r.id for r in rows]
            for chunk in self._chunks(ids):
                conn.execute(
                    update(outbox)
                    .where(self._ids_in(chunk), cond)
                    .values(
                        status=Status.PENDING,
                        attempts=0,
                        nacks=0,
                        available_at=self.clock(),
                        last_error=None,
                        reply_code=None,
                        reply_text=None,
                    )
                )
            result = {"count": len(ids), "matched": matched, "sample": sample, "limit": limit}
            self._notify_new(conn)
            audit_id = conn.execute(
                insert(audit)
                .values(
                    at=self.clock(),
                    actor=actor,
                    action="republish",
                    request_id=request_id,
                    filter=flt.as_json(),
                    count=len(ids),
                    result=result,
                    principal=who[0],
                    client_addr=who[1],
                )
                .returning(audit.c.id)
            ).scalar_one()
            self._operator_events(
                conn, rows, kind="republished", actor=actor, audit_id=int(audit_id)
            )
        return RepublishResult(
            dry_run=False, count=len(ids), matched=matched, sample=sample, audit_id=int(audit_id)
        )

    def _operator_events(
        self,
        conn: Connection,
        rows: Sequence[Any],
        *,
        kind: str,
        actor: str,
        audit_id: int,
        detail: str | None = None,
    ) -> None:
        """An operator's republish or skip, one event per row, as the row was before it."""
        at = self.clock()
        if rows:
            conn.execute(
                insert(events),
                [
                    {
                        "outbox_id": r.id,
                        "message_id": r.message_id,
                        "at": at,
                        "kind": kind,
                        "from_status": r.status,
                        "attempt": r.attempts,
                        "reply_code": r.reply_code,
                        "detail": detail if detail is not None else (r.last_error or r.reply_text),
                        "actor": actor,
                        "audit_id": audit_id,
                    }
                    for r in rows
                ],
            )

    def _notify_new(self, conn: Connection) -> None:
        """Rows became due: wake listening publishers at commit (PostgreSQL; polled otherwise)."""
        if self.is_postgres:
            conn.execute(text("SELECT pg_notify('outbox_new', '')"))

    def skip(
        self,
        *,
        actor: str,
        message_id: str,
        reason: str,
        principal: str | None = None,
        client_addr: str | None = None,
    ) -> SkipResult:
        """Mark one terminal failure ``skipped`` (audited with ``reason``): it will not be
        delivered, and the later rows of its ordering key, parked behind it, are released."""
        reason = reason.strip()
        if not reason:
            raise CannotSkip("a skip needs a reason (it is kept in the audit trail)")
        sources = [s.value for s in TERMINAL_FAILURES]
        for source in TERMINAL_FAILURES:
            check_transition(source, Status.SKIPPED)
        with self._begin() as conn:
            pick = select(
                outbox.c.id,
                outbox.c.message_id,
                outbox.c.status,
                outbox.c.ordering_key,
                outbox.c.attempts,
                outbox.c.reply_code,
                outbox.c.last_error,
                outbox.c.reply_text,
            ).where(outbox.c.message_id == message_id)
            found = conn.execute(pick.with_for_update() if self.is_postgres else pick).first()
            if found is None:
                raise CannotSkip(f"no row with message_id {message_id!r}")
            if found.status not in sources:
                raise CannotSkip(
                    f"{message_id!r} is {found.status}: only a terminal failure "
                    f"({', '.join(sorted(sources))}) can be skipped"
                )
            conn.execute(
                update(outbox)
                .where(outbox.c.id == found.id, outbox.c.status.in_(sources))
                .values(status=Status.SKIPPED, last_error=f"skipped by {actor}: {reason}")
            )
            released = 0
            if found.ordering_key is not None:
                released = conn.execute(
                    select(func.count())
                    .select_from(outbox)
                    .where(
                        outbox.c.ordering_key == found.ordering_key,
                        outbox.c.id > found.id,
                        outbox.c.status == Status.PENDING,
                    )
                ).scalar_one()
            if released:
                self._notify_new(conn)
            result = {
                "message_id": message_id,
                "previous": found.status,
                "ordering_key": found.ordering_key,
                "released": released,
            }
            audit_id = conn.execute(
                insert(audit)
                .values(
                    at=self.clock(),
                    actor=actor,
                    action="skip",
                    filter={"message_id": message_id, "reason": reason},
                    count=1,
                    result=result,
                    principal=principal,
                    client_addr=client_addr,
                )
                .returning(audit.c.id)
            ).scalar_one()
            self._operator_events(
                conn, [found], kind="skipped", actor=actor, audit_id=int(audit_id), detail=reason
            )
        return SkipResult(
            message_id=message_id,
            previous=Status(found.status),
            ordering_key=found.ordering_key,
            released=released,
            audit_id=int(audit_id),
        )

    def count_purgeable(self, *, older_than: dt.timedelta, chunk: int = 10_000) -> int:
        """How many rows :meth:`purge_confirmed` would delete now (a dry run, the same walk)."""
        cutoff = self.clock() - older_than
        total, after = 0, 0
        with self.engine.connect() as conn:
            while True:
                window = conn.execute(_purge_window(after, chunk, cutoff)).all()
                doomed = _purgeable(window)
                total += len(doomed)
                if _past_retention(window, doomed, chunk):
                    return total
                after = window[-1].id

    def record_purge(
        self, *, actor: str, older_than: dt.timedelta, deleted: int, inbox_deleted: int = 0
    ) -> int:
        """An audit row for a purge (who, the retention, what was deleted)."""
        with self._begin() as conn:
            return int(
                conn.execute(
                    insert(audit)
                    .values(
                        at=self.clock(),
                        actor=actor,
                        action="purge",
                        count=deleted,
                        filter={"older_than_days": older_than.total_seconds() / 86400},
                        result={"deleted": deleted, "inbox_deleted": inbox_deleted},
                    )
                    .returning(audit.c.id)
                ).scalar_one()
            )

    def purge_confirmed(
        self,
        *,
        older_than: dt.timedelta,
        chunk: int = 1000,
        on_chunk: Callable[[int], None] | None = None,
    ) -> int:
        """Delete ``confirmed`` rows confirmed before ``now - older_than``.

        Walks the primary key from the oldest row, ``chunk`` rows per transaction (so that no
        long lock or WAL burst stalls the publishers), deleting the confirmed rows past the
        retention among them; stops at the first window with nothing to delete whose rows were
        all written after the cutoff (a row is confirmed after it is written, and ids grow with
        time). Each window is an index range read: the purge costs the rows past retention plus
        one window, never a scan of the whole table. ``on_chunk`` hears each window's deletes."""
        cutoff = self.clock() - older_than
        total, after = 0, 0
        while True:
            with self._begin() as conn:
                window = conn.execute(_purge_window(after, chunk, cutoff)).all()
                doomed = _purgeable(window)
                deleted = 0
                if doomed:
                    deleted = conn.execute(
                        delete(outbox).where(
                            outbox.c.id.in_(doomed),
                            outbox.c.status == Status.CONFIRMED,
                            outbox.c.confirmed_at < cutoff,
                        )
                    ).rowcount
                    gone = ~select(outbox.c.id).where(outbox.c.id == events.c.outbox_id).exists()
                    conn.execute(delete(events).where(events.c.outbox_id.in_(doomed), gone))
            total += deleted
            if on_chunk is not None:
                on_chunk(deleted)
            if _past_retention(window, doomed, chunk):
                return total
            after = window[-1].id


def _purge_window(after: int, chunk: int, cutoff: dt.datetime) -> Select[Any]:
    """The next ``chunk`` rows by id after ``after`` (a range of the primary key), each with
    whether it is past retention and whether it was written after the cutoff (compared in
    SQL: a value a producer stored badly is never parsed here)."""
    doomed = and_(outbox.c.status == Status.CONFIRMED.value, outbox.c.confirmed_at < cutoff)
    fresh = outbox.c.created_at >= cutoff
    return (
        select(outbox.c.id, doomed.label("doomed"), fresh.label("fresh"))
        .where(outbox.c.id > after)
        .order_by(outbox.c.id)
        .limit(chunk)
    )


def _purgeable(window: Sequence[Any]) -> list[int]:
    return [r.id for r in window if r.doomed]


def _past_retention(window: Sequence[Any], doomed: Sequence[int], chunk: int) -> bool:
    """The walk is done: the table ended, or a window held nothing to delete and only rows
    written after the cutoff (later ids are later still)."""
    if len(window) < chunk:
        return True
    return not doomed and all(r.fresh for r in window)


def _spent(row: Any, *, max_attempts: int | None, nack: bool) -> bool:
    """Is this retry the row's last? A nack spends the nack budget; anything else the attempts."""
    if nack:
        return bool(row.nacks + 1 >= row.max_attempts)
    return bool(row.attempts >= (max_attempts or row.max_attempts))
