"""Enqueue messages from application code, inside the caller's own transaction.

::

    with Session(engine) as session, session.begin():
        session.add(order)
        enqueue(session, [Message(exchange="orders", routing_key="order.created",
                                  body=payload, message_id=f"order-{order.id}-created")])
    # COMMIT: the order and its message exist together, or neither does

- **The caller's transaction.** :func:`enqueue` (SQLAlchemy ``Session`` or ``Connection``),
  :func:`enqueue_async` (``AsyncSession`` or ``AsyncConnection``) and :func:`enqueue_psycopg`
  (a psycopg 3 connection) only execute statements on what they are given: they never begin a
  transaction of their own, commit or roll back. The publisher sees the rows when the caller
  commits; on PostgreSQL the insert's trigger (migration 0008) sends ``NOTIFY outbox_new``, which
  PostgreSQL delivers at that commit, so a listening publisher claims them at once.
- **The same rules as the Spark writer.** Every message goes through
  :func:`app.outbox.content.check_row`, the check the publisher itself applies, before anything is
  written: a call with one bad message writes none of its messages and raises
  :class:`InvalidMessage` naming the message (its index and id) and the reason. Messages of
  earlier calls in the same transaction are untouched.
- **Idempotent by ``message_id``.** A message whose id is already in the outbox with the same
  content (exchange, routing key, body, content type, headers, properties, ordering key) is a
  duplicate: no second row, reported in :attr:`Enqueued.duplicates`. The same id with other
  content raises :class:`MessageConflict` before anything is written. Trace headers and the
  delivery time are not content: a retried request that enqueues the same message again in
  another trace, or with a delay computed again, is a duplicate.
- **Many messages in one call**: one lookup of the call's ids (one array parameter on
  PostgreSQL), then the new rows in one ``executemany`` of the plain ``INSERT`` an application
  would write by hand (the optional columns only when a message sets them). Measured for 10,000
  messages (bench/workloads/enqueue.py): ``INSERT ... ON CONFLICT DO NOTHING RETURNING``
  cost 2.1-2.5 x the plain ``executemany``. The unique index still guards the insert: an id
  another transaction commits between the lookup and the insert raises :class:`EnqueueRaced`
  (the database refused the statement: roll back).
- **Delayed delivery.** ``not_before`` (a timezone-aware time) is stored, and the row's
  ``available_at`` (the claim's due time) is the later of it and the database's ``now()``.
- **Trace context.** ``traceparent``/``tracestate`` become AMQP headers of the same name; left
  out, they come from the current OpenTelemetry context when ``opentelemetry`` is installed
  (:mod:`app.tracing`), and nothing is imported when it is not.

The message model, its checks and errors are :mod:`app.outbox.message` (pure), re-exported
here: ``from app.outbox.enqueue import Message, enqueue`` is the API. Importing this module needs
SQLAlchemy only: nothing of the publisher, no broker client.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Insert,
    Select,
    TextClause,
    bindparam,
    case,
    func,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from app.outbox.content import Limits
from app.outbox.message import (
    CONTENT_COLUMNS,
    DEFAULT_LIMITS,
    DEFAULT_SOURCE,
    METRICS,
    Enqueued,
    EnqueueError,
    EnqueueRaced,
    InvalidMessage,
    Message,
    MessageConflict,
    differing,
    enqueue_collector,
    prepare,
)
from app.outbox.schema import outbox

__all__ = [
    "EnqueueError",
    "EnqueueRaced",
    "Enqueued",
    "InvalidMessage",
    "Limits",
    "Message",
    "MessageConflict",
    "enqueue",
    "enqueue_async",
    "enqueue_collector",
    "enqueue_psycopg",
]

log = logging.getLogger(__name__)

#: How each backend names the unique index a racing insert violates.
_UNIQUE_ID = ("uq_outbox_message_id", "UNIQUE constraint failed: outbox.message_id")
#: Ids looked up per statement when duplicates are compared (below every backend's
#: bound-parameter limit).
LOOKUP_PAGE = 1000


# --------------------------------------------------------------------------- statements

#: Always written; the optional columns below only when a row of the call sets them, so a call
#: of plain messages sends what a hand-written INSERT would (defaults from the table).
_COLUMNS = (
    "message_id",
    "batch_id",
    "exchange",
    "routing_key",
    "body",
    "content_type",
    "headers",
    "properties",
)
#: column -> its value when left to the table's default
_OPTIONAL = {"mandatory": True, "ordering_key": None, "not_before": None, "stream": None}


def optional_columns(rows: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The optional columns some row of the call sets (the statement's shape)."""
    return tuple(c for c, default in _OPTIONAL.items() if any(r[c] != default for r in rows))


@functools.cache
def insert_statement(dialect: str, optional: tuple[str, ...] = ()) -> Insert:
    """The ``INSERT``, values bound by column name, run as an ``executemany``. With
    ``not_before``, ``available_at`` is the later of it and the database's clock."""
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    values: dict[str, Any] = {
        c: bindparam(c, type_=outbox.c[c].type) for c in (*_COLUMNS, *optional)
    }
    if "not_before" in optional:
        not_before = values["not_before"]
        values["available_at"] = case((not_before > func.now(), not_before), else_=func.now())
    return make(outbox).values(values)


@functools.cache
def insert_one_statement(dialect: str, optional: tuple[str, ...] = ()) -> TextClause:
    """One message's ``INSERT … ON CONFLICT (message_id) DO NOTHING RETURNING id``: the whole
    call in one round trip when the id is new (the ordinary web request), the stored row looked
    up and compared only when it is not.

    Built from :func:`insert_statement`, compiled once here and kept as typed text: SQLAlchemy
    2.0's dialect ``Insert`` (``ON CONFLICT``) has no cache key, so it was compiled again on
    every call, 0.75 ms of CPU per message on this machine."""
    base = insert_statement(dialect, optional)
    assert isinstance(base, postgresql.Insert | sqlite.Insert)
    stmt = base.on_conflict_do_nothing(index_elements=["message_id"]).returning(outbox.c.id)
    named = (postgresql if dialect == "postgresql" else sqlite).dialect(paramstyle="named")
    binds = [bindparam(c, type_=outbox.c[c].type) for c in (*_COLUMNS, *optional)]
    sql = str(stmt.compile(dialect=named))
    sql = re.sub(r":(\w+)::(\w+)", r"CAST(:\1 AS \2)", sql)  # text() reads '::' as no bind
    return text(sql).bindparams(*binds)


def _settled_one(row: dict[str, Any], inserted: bool, stored: Iterable[Any]) -> Enqueued:
    """The outcome of one message's insert: new, a duplicate of the stored row, or a conflict
    with it. A conflict on an id this transaction cannot see (a concurrent transaction's row,
    seen through a snapshot that predates it) is a race."""
    if inserted:
        return outcome([row], [row])
    found = list(stored)
    if not found:
        METRICS.add(conflicts=1)
        log.warning("enqueue raced another transaction on message_id %r", row["message_id"])
        raise EnqueueRaced(
            f"another transaction holds message_id {row['message_id']!r} and this one cannot "
            "see it yet: roll back, and retry if you like (the retry compares them)"
        )
    return outcome([row], sort_out([row], found))


def stored_statement(ids: Sequence[str]) -> Select[Any]:
    """The stored content of these ids (PostgreSQL: one array parameter; SQLite: ``IN``)."""
    return select(outbox.c.message_id, *(outbox.c[c] for c in CONTENT_COLUMNS)).where(
        outbox.c.message_id.in_(list(ids))
    )


def _pages(ids: Sequence[str], size: int) -> Iterable[Sequence[str]]:
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def _lookup_page(dialect: str) -> int:
    """Ids per lookup: PostgreSQL takes them as one array (``= ANY``), SQLite as ``IN`` with one
    parameter each (below its limit of 32,766)."""
    return 1_000_000 if dialect == "postgresql" else LOOKUP_PAGE


def _stored_pg(ids: Sequence[str]) -> Select[Any]:
    return select(outbox.c.message_id, *(outbox.c[c] for c in CONTENT_COLUMNS)).where(
        outbox.c.message_id
        == func.any(
            bindparam("ids", value=list(ids), type_=postgresql.ARRAY(outbox.c.message_id.type))
        )
    )


def _stored(dialect: str, ids: Sequence[str]) -> Iterable[Select[Any]]:
    for page in _pages(ids, _lookup_page(dialect)):
        yield _stored_pg(page) if dialect == "postgresql" else stored_statement(page)


def sort_out(rows: Sequence[dict[str, Any]], stored: Iterable[Any]) -> list[dict[str, Any]]:
    """The rows to insert: those whose id is not stored yet. A stored id with the same content
    is a duplicate; with other content, :class:`MessageConflict` (nothing written yet)."""
    by_id = {row["message_id"]: row for row in rows}
    for found in stored:
        mapping = found._mapping
        columns = differing(mapping, by_id[mapping["message_id"]])
        if columns:
            METRICS.add(conflicts=1)
            log.warning(
                "enqueue refused message_id %r: stored with another %s",
                mapping["message_id"],
                ", ".join(columns),
            )
            raise MessageConflict(message_id=mapping["message_id"], columns=columns)
        del by_id[mapping["message_id"]]
    return list(by_id.values())


def outcome(rows: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> Enqueued:
    inserted = tuple(r["message_id"] for r in new)
    fresh = set(inserted)
    duplicates = tuple(r["message_id"] for r in rows if r["message_id"] not in fresh)
    delayed = sum(1 for r in new if r["not_before"] is not None)
    METRICS.add(inserted=len(inserted), duplicates=len(duplicates), delayed=delayed)
    log.debug(
        "enqueued %d messages (%d delayed), %d duplicates", len(inserted), delayed, len(duplicates)
    )
    return Enqueued(inserted=inserted, duplicates=duplicates)


@contextlib.contextmanager
def _guarded(count: int) -> Iterator[None]:
    """A unique violation on ``message_id``: another transaction committed one of the new ids
    between the lookup and the insert (rare). The database refused the statement, so the
    caller must roll back; a retry then sees those rows and compares them."""
    try:
        yield
    except Exception as exc:
        if not any(marker in str(exc) for marker in _UNIQUE_ID):
            raise
        METRICS.add(conflicts=1)
        log.warning("enqueue raced another transaction on its %d new message ids", count)
        raise EnqueueRaced(
            f"another transaction wrote one of these {count} message ids between this call's "
            "lookup and its insert: roll back, and retry if you like (the retry compares them)"
        ) from exc


# --------------------------------------------------------------------------- executors


def enqueue(
    target: Session | Connection,
    messages: Iterable[Message],
    *,
    source: str = DEFAULT_SOURCE,
    limits: Limits = DEFAULT_LIMITS,
) -> Enqueued:
    """Write ``messages`` into the outbox on ``target``'s current transaction (begun if none,
    as SQLAlchemy does for any statement); never commits. ``source`` is the rows' ``batch_id``
    (the service's name, say). Raises :class:`InvalidMessage` or :class:`MessageConflict`,
    having written nothing of this call."""
    rows = prepare(messages, source=source, limits=limits)
    if not rows:
        return Enqueued(inserted=(), duplicates=())
    conn = target.connection() if isinstance(target, Session) else target
    dialect = conn.dialect.name
    ids = [r["message_id"] for r in rows]
    if len(rows) == 1:
        [row] = rows
        one = insert_one_statement(dialect, optional_columns(rows))
        inserted = conn.execute(one, row).first() is not None
        stored = () if inserted else conn.execute(next(iter(_stored(dialect, ids))))
        return _settled_one(row, inserted, stored)
    new = sort_out(rows, [f for stmt in _stored(dialect, ids) for f in conn.execute(stmt)])
    if new:
        with _guarded(len(new)):
            conn.execute(insert_statement(dialect, optional_columns(new)), new)
    return outcome(rows, new)


async def enqueue_async(
    target: AsyncSession | AsyncConnection,
    messages: Iterable[Message],
    *,
    source: str = DEFAULT_SOURCE,
    limits: Limits = DEFAULT_LIMITS,
) -> Enqueued:
    """:func:`enqueue` on an ``AsyncSession`` or ``AsyncConnection`` (e.g. ``postgresql+psycopg``
    with ``create_async_engine``)."""
    rows = prepare(messages, source=source, limits=limits)
    if not rows:
        return Enqueued(inserted=(), duplicates=())
    conn = await target.connection() if isinstance(target, AsyncSession) else target
    dialect = conn.dialect.name
    if len(rows) == 1:
        [row] = rows
        one = insert_one_statement(dialect, optional_columns(rows))
        inserted = (await conn.execute(one, row)).first() is not None
        lookup = next(iter(_stored(dialect, [row["message_id"]])))
        return _settled_one(row, inserted, () if inserted else await conn.execute(lookup))
    found: list[Any] = []
    for lookup in _stored(dialect, [r["message_id"] for r in rows]):
        found += list(await conn.execute(lookup))
    new = sort_out(rows, found)
    if new:
        with _guarded(len(new)):
            await conn.execute(insert_statement(dialect, optional_columns(new)), new)
    return outcome(rows, new)


@functools.cache
def psycopg_insert(optional: tuple[str, ...]) -> str:
    """The statement of :func:`enqueue_psycopg`, shaped like :func:`insert_statement`."""
    columns = [*_COLUMNS, *optional]
    values = [f"%({c})s" for c in columns]
    if "not_before" in optional:
        columns.append("available_at")
        values.append("greatest(%(not_before)s, now())")
    return f"INSERT INTO outbox ({', '.join(columns)}) VALUES ({', '.join(values)})"


@functools.cache
def psycopg_insert_one(optional: tuple[str, ...]) -> str:
    """:func:`psycopg_insert` for one message: new, or nothing written and nothing returned."""
    return psycopg_insert(optional) + " ON CONFLICT (message_id) DO NOTHING RETURNING id"


_PSYCOPG_STORED = (
    "SELECT message_id, exchange, routing_key, body, content_type, headers, properties,"
    " ordering_key FROM outbox WHERE message_id = ANY(%s)"
)


def enqueue_psycopg(
    conn: Any,
    messages: Iterable[Message],
    *,
    source: str = DEFAULT_SOURCE,
    limits: Limits = DEFAULT_LIMITS,
) -> Enqueued:
    """:func:`enqueue` on a plain psycopg 3 connection (PostgreSQL), in its current transaction.
    Refuses an ``autocommit`` connection: each message would commit on its own."""
    from psycopg.rows import namedtuple_row
    from psycopg.types.json import Json

    if conn.autocommit:
        raise EnqueueError("enqueue_psycopg needs a connection in a transaction, not autocommit")
    rows = prepare(messages, source=source, limits=limits)
    if not rows:
        return Enqueued(inserted=(), duplicates=())
    with conn.cursor(row_factory=namedtuple_row) as cur:
        if len(rows) == 1:
            [row] = rows
            one = dict(row, headers=_json(row["headers"], Json))
            one["properties"] = _json(row["properties"], Json)
            inserted = cur.execute(psycopg_insert_one(optional_columns(rows)), one).fetchone()
            stored = () if inserted else cur.execute(_PSYCOPG_STORED, ([row["message_id"]],))
            return _settled_one(row, inserted is not None, [_Stored(f) for f in stored])
        found = cur.execute(_PSYCOPG_STORED, ([r["message_id"] for r in rows],)).fetchall()
        new = sort_out(rows, [_Stored(f) for f in found])
        if new:
            statement = psycopg_insert(optional_columns(new))
            for r in new:  # the call's own rows: wrapped in place, not copied
                r["headers"] = _json(r["headers"], Json)
                r["properties"] = _json(r["properties"], Json)
            with _guarded(len(new)):
                cur.executemany(statement, new)
    return outcome(rows, new)


def _json(value: Any, wrap: Any) -> Any:
    return None if value is None else wrap(value)


class _Stored:
    """A psycopg row seen as a SQLAlchemy row (``._mapping`` and attributes)."""

    def __init__(self, row: Any) -> None:
        self._mapping = row._asdict()
