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
  content raises :class:`MessageConflict`, and the call leaves nothing behind. Trace headers and
  the delivery time are not content: a retried request that enqueues the same message again in
  another trace, or with a delay computed again, is a duplicate.
- **Many messages, one round trip per 1,000.** One multi-row ``INSERT ... ON CONFLICT
  (message_id) DO NOTHING RETURNING message_id`` per page (SQLAlchemy's "insertmanyvalues" with
  psycopg and sqlite3; psycopg's pipelined ``executemany`` for :func:`enqueue_psycopg`).
- **Delayed delivery.** ``not_before`` (a timezone-aware time) is stored, and the row's
  ``available_at`` (the claim's due time) is the later of it and the database's ``now()``.
- **Trace context.** ``traceparent``/``tracestate`` become AMQP headers of the same name; left
  out, they come from the current OpenTelemetry context when ``opentelemetry`` is installed
  (:mod:`app.tracing`), and nothing is imported when it is not.

Importing this module needs SQLAlchemy only: nothing of the publisher, no broker client.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Connection,
    Insert,
    Select,
    bindparam,
    case,
    delete,
    func,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from app import tracing
from app.outbox.content import (
    ContentError,
    Limits,
    check_headers,
    check_row,
    check_shortstr,
)
from app.outbox.schema import outbox

log = logging.getLogger(__name__)

#: The default ``batch_id`` of application messages (the Spark writer's are ``sink:batch``).
DEFAULT_SOURCE = "app"
#: ``not_before`` at or after this is the Spark data source's "parked" marker, not a delay.
LATEST_NOT_BEFORE = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)
#: Headers that are not part of a message's content when a re-enqueue is compared.
TRACE_HEADERS = frozenset({tracing.TRACEPARENT, tracing.TRACESTATE})
#: Duplicates are compared on these columns (``headers`` without :data:`TRACE_HEADERS`).
CONTENT_COLUMNS = ("exchange", "routing_key", "body", "content_type", "headers", "properties",
                   "ordering_key")  # fmt: skip
DEFAULT_LIMITS = Limits()
#: Ids looked up per statement when duplicates are compared (below every backend's
#: bound-parameter limit).
LOOKUP_PAGE = 1000


# ---------------------------------------------------------------------------- errors


class EnqueueError(ValueError):
    """A message the outbox cannot take. Nothing of the call that raised it was written."""


class InvalidMessage(EnqueueError, ContentError):
    """A message breaks a rule of :mod:`app.outbox.content` (or of this API): its ``index`` in
    the call, its ``message_id`` (when it has a usable one) and the ``reason``."""

    def __init__(self, *, index: int, message_id: object, reason: str) -> None:
        self.index = index
        self.message_id = message_id if isinstance(message_id, str) else None
        self.reason = reason
        shown = f" (message_id {message_id[:80]!r})" if isinstance(message_id, str) else ""
        super().__init__(f"message {index}{shown}: {reason}")


class MessageConflict(EnqueueError):
    """A ``message_id`` already in the outbox (or twice in the call) with other content."""

    def __init__(self, *, message_id: str, columns: Sequence[str]) -> None:
        self.message_id = message_id
        self.columns = tuple(columns)
        super().__init__(
            f"message_id {message_id[:80]!r} is already in the outbox with another "
            f"{', '.join(columns)}: a message id names one message; give the new one its own id"
        )


# ----------------------------------------------------------------------------- model


def new_message_id() -> str:
    """A random id: unique, but a message rebuilt on a retry gets another one. Give a message
    an id derived from your own data (``order-42-created``) to make re-enqueueing idempotent."""
    return str(uuid.uuid4())


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One message, as the Spark writer's rows carry it (see docs/applications.md)."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str = field(default_factory=new_message_id)
    content_type: str | None = None
    headers: Mapping[str, Any] | None = None
    #: AMQP basic properties: ``priority``, ``expiration``, ``correlation_id``, ``type``, ...
    properties: Mapping[str, Any] | None = None
    #: messages of one key reach the broker in enqueue order (a delayed one holds later ones)
    ordering_key: str | None = None
    #: never published before this time (timezone-aware)
    not_before: dt.datetime | None = None
    mandatory: bool = True
    #: a W3C trace context; None: the current OpenTelemetry context, if any
    traceparent: str | None = None
    tracestate: str | None = None


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What a call did: the ids it inserted and those already in the outbox (same content)."""

    inserted: tuple[str, ...]
    duplicates: tuple[str, ...]


# ---------------------------------------------------------------------------- metrics


@dataclass
class EnqueueMetrics:
    """Counters of this process's enqueue calls (monotonic; see :func:`enqueue_collector`)."""

    inserted: int = 0
    duplicates: int = 0
    invalid: int = 0
    conflicts: int = 0
    delayed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


#: One per process, like a Prometheus registry: enqueue calls come from any thread or task.
METRICS = EnqueueMetrics()


def enqueue_collector(metrics: EnqueueMetrics = METRICS) -> Any:
    """A Prometheus collector of the enqueue counters, for the application's own registry:
    ``prometheus_client.REGISTRY.register(enqueue_collector())``."""
    from prometheus_client.core import CounterMetricFamily

    class _Collector:
        def collect(self) -> Iterable[Any]:
            fam = CounterMetricFamily(
                "outbox_enqueue_messages", "Messages handed to enqueue, by outcome",
                labels=["outcome"],
            )  # fmt: skip
            for outcome in ("inserted", "duplicates", "invalid", "conflicts", "delayed"):
                fam.add_metric([outcome], getattr(metrics, outcome))
            yield fam

    return _Collector()


# ---------------------------------------------------------------- pure: rows to write


def prepare(
    messages: Iterable[Message], *, source: str = DEFAULT_SOURCE, limits: Limits = DEFAULT_LIMITS
) -> list[dict[str, Any]]:
    """Messages -> outbox rows (column values), each checked; raises :class:`InvalidMessage`
    for the first bad one, or :class:`MessageConflict` for one id twice with other content.
    A message given twice with the same content becomes one row."""
    batch_id = check_shortstr(source, what="source")
    rows: dict[str, dict[str, Any]] = {}
    context = tracing.current_context()
    for index, message in enumerate(messages):
        try:
            row = _row(message, batch_id=batch_id, limits=limits, context=context)
        except ContentError as exc:
            METRICS.add(invalid=1)
            mid = getattr(message, "message_id", None)
            log.warning("enqueue refused message %d: %s", index, exc)
            raise InvalidMessage(index=index, message_id=mid, reason=str(exc)) from None
        seen = rows.get(row["message_id"])
        if seen is None:
            rows[row["message_id"]] = row
        elif differing(seen, row):
            METRICS.add(conflicts=1)
            raise MessageConflict(message_id=row["message_id"], columns=differing(seen, row))
    return list(rows.values())


def _row(
    message: object, *, batch_id: str, limits: Limits, context: tracing.TraceContext | None
) -> dict[str, Any]:
    if not isinstance(message, Message):
        raise ContentError(f"expected an outbox Message, got {type(message).__name__}")
    headers = check_headers(dict(message.headers or {}) or None, max_bytes=limits.max_header_bytes)
    headers.update(_trace_headers(message, context))
    properties = dict(message.properties) if message.properties is not None else None
    checked = check_row(
        exchange=message.exchange, routing_key=message.routing_key,
        message_id=message.message_id, body=message.body, content_type=message.content_type,
        headers=headers, properties=properties, limits=limits,
    )  # fmt: skip
    return {
        "message_id": checked.message_id, "batch_id": batch_id, "exchange": checked.exchange,
        "routing_key": checked.routing_key, "mandatory": _mandatory(message.mandatory),
        "body": bytes(message.body), "content_type": checked.content_type,
        "headers": checked.headers or None, "properties": properties,
        "ordering_key": _ordering_key(message.ordering_key),
        "not_before": _not_before(message.not_before),
    }  # fmt: skip


def _trace_headers(message: Message, context: tracing.TraceContext | None) -> dict[str, str]:
    if message.traceparent is not None:
        return tracing.checked_headers(message.traceparent, message.tracestate)
    if message.tracestate is not None:
        raise ContentError("tracestate given without a traceparent")
    return dict(context) if context else {}


def _mandatory(value: object) -> bool:
    if not isinstance(value, bool):
        raise ContentError(f"mandatory must be a boolean, got {type(value).__name__}")
    return value


def _ordering_key(value: object) -> str | None:
    if value is None:
        return None
    return check_shortstr(value, what="ordering key")


def _not_before(value: object) -> dt.datetime | None:
    if value is None:
        return None
    if not isinstance(value, dt.datetime):
        raise ContentError(f"not_before must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ContentError("not_before must be timezone-aware (a naive time is ambiguous)")
    stamp = value.astimezone(dt.UTC)
    if stamp >= LATEST_NOT_BEFORE:
        raise ContentError(f"not_before {stamp.isoformat()} is later than the year 9998")
    return stamp


def differing(stored: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The content columns in which two rows of one message_id differ (empty: the same)."""
    return [c for c in CONTENT_COLUMNS if _content(c, stored.get(c)) != _content(c, new.get(c))]


def _content(column: str, value: Any) -> Any:
    if column == "body" and value is not None:
        return bytes(value)
    if column in ("headers", "properties"):
        if isinstance(value, str | bytes):
            value = json.loads(value)
        value = dict(value or {})
        if column == "headers":
            value = {k: v for k, v in value.items() if k not in TRACE_HEADERS}
        return value
    return value


# --------------------------------------------------------------------------- statements

_COLUMNS = ("message_id", "batch_id", "exchange", "routing_key", "mandatory", "body",
            "content_type", "headers", "properties", "ordering_key")  # fmt: skip


def insert_statement(dialect: str) -> Insert:
    """``INSERT ... ON CONFLICT (message_id) DO NOTHING RETURNING message_id``, values bound by
    column name; ``available_at`` the later of ``not_before`` and the database's clock."""
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    not_before = bindparam("not_before", type_=outbox.c.not_before.type)
    values: dict[str, Any] = {c: bindparam(c, type_=outbox.c[c].type) for c in _COLUMNS}
    values["not_before"] = not_before
    values["available_at"] = case((not_before > func.now(), not_before), else_=func.now())
    stmt = make(outbox).values(values)
    return stmt.on_conflict_do_nothing(index_elements=["message_id"]).returning(outbox.c.message_id)


def stored_statement(ids: Sequence[str]) -> Select[Any]:
    return select(outbox.c.message_id, *(outbox.c[c] for c in CONTENT_COLUMNS)).where(
        outbox.c.message_id.in_(list(ids))
    )


def _pages(ids: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(ids), LOOKUP_PAGE):
        yield ids[start : start + LOOKUP_PAGE]


def settle(
    rows: Sequence[dict[str, Any]], inserted: set[str], stored: Iterable[Any]
) -> Enqueued | MessageConflict:
    """The call's outcome from the ids the insert returned and the stored rows of the others."""
    by_id = {row["message_id"]: row for row in rows}
    for found in stored:
        columns = differing(found._mapping, by_id[found.message_id])
        if columns:
            METRICS.add(conflicts=1)
            log.warning("enqueue refused message_id %r: stored with another %s",
                        found.message_id, ", ".join(columns))  # fmt: skip
            return MessageConflict(message_id=found.message_id, columns=columns)
    duplicates = tuple(r["message_id"] for r in rows if r["message_id"] not in inserted)
    ids = tuple(r["message_id"] for r in rows if r["message_id"] in inserted)
    delayed = sum(1 for r in rows if r["not_before"] is not None and r["message_id"] in inserted)
    METRICS.add(inserted=len(ids), duplicates=len(duplicates), delayed=delayed)
    log.debug("enqueued %d messages (%d delayed), %d duplicates", len(ids), delayed,
              len(duplicates))  # fmt: skip
    return Enqueued(inserted=ids, duplicates=duplicates)


def _undo(ids: Sequence[str]) -> Any:
    return delete(outbox).where(outbox.c.message_id.in_(list(ids)))


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
    result = conn.execute(insert_statement(conn.dialect.name), rows)
    inserted = set(result.scalars().all())
    others = [r["message_id"] for r in rows if r["message_id"] not in inserted]
    stored = [row for page in _pages(others) for row in conn.execute(stored_statement(page))]
    outcome = settle(rows, inserted, stored)
    if isinstance(outcome, MessageConflict):
        for page in _pages(sorted(inserted)):
            conn.execute(_undo(page))
        raise outcome
    return outcome


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
    result = await conn.execute(insert_statement(conn.dialect.name), rows)
    inserted = set(result.scalars().all())
    others = [r["message_id"] for r in rows if r["message_id"] not in inserted]
    stored = []
    for page in _pages(others):
        stored += list(await conn.execute(stored_statement(page)))
    outcome = settle(rows, inserted, stored)
    if isinstance(outcome, MessageConflict):
        for page in _pages(sorted(inserted)):
            await conn.execute(_undo(page))
        raise outcome
    return outcome


_PSYCOPG_INSERT = (
    "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, mandatory, body,"
    " content_type, headers, properties, ordering_key, not_before, available_at)"
    " VALUES (%(message_id)s, %(batch_id)s, %(exchange)s, %(routing_key)s, %(mandatory)s,"
    " %(body)s, %(content_type)s, %(headers)s, %(properties)s, %(ordering_key)s,"
    " %(not_before)s, greatest(%(not_before)s, now()))"
    " ON CONFLICT (message_id) DO NOTHING RETURNING message_id"
)
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
    params = [{**r, "headers": _json(r["headers"], Json),
               "properties": _json(r["properties"], Json)} for r in rows]  # fmt: skip
    inserted: set[str] = set()
    with conn.cursor(row_factory=namedtuple_row) as cur:
        cur.executemany(_PSYCOPG_INSERT, params, returning=True)
        while True:
            inserted.update(r.message_id for r in cur.fetchall())
            if not cur.nextset():
                break
        others = [r["message_id"] for r in rows if r["message_id"] not in inserted]
        stored = cur.execute(_PSYCOPG_STORED, (others,)).fetchall() if others else []
        outcome = settle(rows, inserted, [_Stored(s) for s in stored])
        if isinstance(outcome, MessageConflict):
            cur.execute("DELETE FROM outbox WHERE message_id = ANY(%s)", (sorted(inserted),))
            raise outcome
    return outcome


def _json(value: Any, wrap: Any) -> Any:
    return None if value is None else wrap(value)


class _Stored:
    """A psycopg row seen as a SQLAlchemy row (``._mapping`` and attributes)."""

    def __init__(self, row: Any) -> None:
        self._mapping = row._asdict()
        self.message_id = row.message_id
