"""An application's message and how it becomes an outbox row: the model, the checks (the
rules every writer shares, :mod:`app.outbox.content`), trace headers and delays, duplicate
comparison, the errors and the counters. Pure: no database, no driver (:mod:`app.outbox.enqueue`
writes the rows).
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

from app import tracing
from app.outbox.content import ContentError, Limits, check_row, check_shortstr
from app.streams.names import StreamNameError, check_stream_name

log = logging.getLogger("app.outbox.enqueue")

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
    "stream",
)
DEFAULT_LIMITS = Limits()


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

    #: an exchange and routing key, or a ``stream`` (then both stay empty)
    exchange: str = ""
    routing_key: str = ""
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
    #: a RabbitMQ stream to append the message to, exactly once (docs/streams.md), instead of
    #: an exchange
    stream: str | None = None


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
    stream = _stream(message)
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
        "stream": stream,
    }


def _stream(message: Message) -> str | None:
    """The stream a message names (checked), None for an exchange's; a message names one or
    the other, never both, never neither."""
    if message.stream is None:
        if message.exchange == "" and message.routing_key == "":
            raise ContentError(
                "a message names an exchange and a routing key, or a stream; this one names none"
            )
        return None
    if message.exchange or message.routing_key:
        raise ContentError(
            f"a message for stream {message.stream!r} names no exchange or routing key "
            f"(got exchange {message.exchange!r}, routing key {message.routing_key!r})"
        )
    if message.ordering_key is not None:
        raise ContentError(
            "a stream keeps its messages in order by itself (one lane: id order); "
            "ordering_key is for exchanges"
        )
    try:
        return check_stream_name(message.stream)
    except StreamNameError as exc:
        raise ContentError(str(exc)) from None


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
