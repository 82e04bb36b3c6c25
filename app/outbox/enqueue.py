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

Importing this module needs SQLAlchemy only: nothing of the publisher, no broker client.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import re
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
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

from app import tracing
from app.outbox.content import (
    ContentError,
    Limits,
    check_row,
    check_shortstr,
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

#: The default ``batch_id`` of application messages (the Spark writer's are ``sink:batch``).
DEFAULT_SOURCE = "app"
#: ``not_before`` at or after this is the Spark data source's "parked" marker, not a delay.
LATEST_NOT_BEFORE = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)
#: Headers that are not part of a message's content when a re-enqueue is compared.
TRACE_HEADERS = frozenset({tracing.TRACEPARENT, tracing.TRACESTATE})
#: Duplicates are compared on these columns (``headers`` without :data:`TRACE_HEADERS`).
CONTENT_COLUMNS = (
    "exchange",
    "routing_key",
    "body",
    "content_type",
    "headers",
    "properties",
    "ordering_key",
)
DEFAULT_LIMITS = Limits()
#: How each backend names the unique index a racing insert violates.
_UNIQUE_ID = ("uq_outbox_message_id", "UNIQUE constraint failed: outbox.message_id")
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


class EnqueueRaced(EnqueueError):
    """Another transaction committed one of the call's new message ids while it ran: the
    database refused the insert (its unique index). Roll the transaction back (the only error
    of this module that needs it)."""


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
    #: messages whose trace context was malformed and ignored (W3C: a new trace starts)
    trace_ignored: int = 0
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
                "outbox_enqueue_messages",
                "Messages handed to enqueue, by outcome",
                labels=["outcome"],
            )
            for outcome in (
                "inserted",
                "duplicates",
                "invalid",
                "conflicts",
                "delayed",
                "trace_ignored",
            ):
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
    headers = _own_trace_checked(_mapping(message.headers, what="headers"), message)
    own = headers is not None and tracing.TRACEPARENT in headers  # its own traceparent stays
    if message.traceparent is not None or (message.tracestate is not None and not own):
        headers = {**(headers or {}), **_trace_headers(message, context)}
    elif context and not own:
        headers = {**(headers or {}), **context}
    properties = _mapping(message.properties, what="properties")
    checked = check_row(
        exchange=message.exchange,
        routing_key=message.routing_key,
        message_id=message.message_id,
        body=message.body,
        content_type=message.content_type,
        headers=headers or None,
        properties=properties,
        limits=limits,
    )
    return {
        "message_id": checked.message_id,
        "batch_id": batch_id,
        "exchange": checked.exchange,
        "routing_key": checked.routing_key,
        "mandatory": _mandatory(message.mandatory),
        "body": bytes(message.body),
        "content_type": checked.content_type,
        "headers": checked.headers or None,
        "properties": properties,
        "ordering_key": _ordering_key(message.ordering_key),
        "not_before": _not_before(message.not_before),
    }


def _mapping(value: object, *, what: str) -> dict[str, Any] | None:
    """The caller's dict itself (never changed here), or another mapping as a dict."""
    if value is None or type(value) is dict:
        return value
    if not isinstance(value, Mapping):
        raise ContentError(f"{what} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _trace_headers(message: Message, context: tracing.TraceContext | None) -> dict[str, str]:
    """The trace context a message carries: its ``traceparent=`` (and ``tracestate=``), or the
    current span's. Usually copied from an incoming request, so malformed is the client's doing:
    W3C Trace Context says an invalid parent is ignored and a new trace started, never that the
    request fails (issue 48: a client's bad header was a 500 for the whole request)."""
    if message.traceparent is not None:
        if not isinstance(message.traceparent, str):  # not a header value: the caller's bug
            raise ContentError(
                f"traceparent must be a string, got {type(message.traceparent).__name__}"
            )
        try:
            return tracing.checked_headers(message.traceparent, message.tracestate)
        except tracing.TraceContextError as exc:
            _trace_ignored(message, str(exc))
    elif message.tracestate is not None:
        _trace_ignored(message, "tracestate given without a traceparent")
    return dict(context) if context else {}


def _own_trace_checked(headers: dict[str, Any] | None, message: Message) -> dict[str, Any] | None:
    """A message's own ``traceparent`` header (and its ``tracestate``), checked like
    ``traceparent=``: malformed, both are left out (a new trace), never sent on unchecked."""
    if headers is None or tracing.TRACEPARENT not in headers:
        return headers
    try:
        tracing.checked_headers(headers[tracing.TRACEPARENT], headers.get(tracing.TRACESTATE))
    except tracing.TraceContextError as exc:
        _trace_ignored(message, f"its traceparent header: {exc}")
        return {
            k: v for k, v in headers.items() if k not in (tracing.TRACEPARENT, tracing.TRACESTATE)
        }
    return headers


def _trace_ignored(message: Message, why: str) -> None:
    METRICS.add(trace_ignored=1)
    log.debug("message %r: trace context ignored, a new trace starts: %s", message.message_id, why)


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
    """A column's value as compared. A stored JSON column that is not an object (a row someone
    wrote by hand) compares as itself: it differs from any message, never crashes the call."""
    if column == "body" and value is not None:
        return bytes(value)
    if column in ("headers", "properties"):
        if isinstance(value, str | bytes):
            try:
                value = json.loads(value)
            except ValueError:
                return ("unreadable", value)
        if value is None:
            return {}
        if not isinstance(value, dict):
            return ("not an object", value)
        if column == "headers":
            return {k: v for k, v in value.items() if k not in TRACE_HEADERS}
    return value


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
_OPTIONAL = {"mandatory": True, "ordering_key": None, "not_before": None}


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
