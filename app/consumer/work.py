"""What a handler thread does with deliveries: a window in one transaction, or one message alone.

Two kinds of job, each on a database connection of its own, each returning an :class:`Outcome`
that says, delivery by delivery, what happened (the event loop then acks, requeues, rejects or
queues it again):

- :func:`run_window` (batched mode, first deliveries): one transaction for up to ``batch_size``
  deliveries: the handler once per message (or a batch handler once for them all), their inbox
  rows in one ``INSERT … ON CONFLICT DO NOTHING`` (ids sorted), one ``COMMIT``. A handler that
  raises costs only its own message: the transaction is rolled back and the others are handed
  back to run again without it (a batch handler's window runs again one message at a time).
- :func:`run_single` (a message alone: the per-message mode, a redelivered message, a failure to
  record): the inbox row first, then the handler, one ``COMMIT``. A redelivered message is
  *charged* first (its attempt counted and committed before its handler runs), so a message
  that kills the process is counted although nothing runs after it.

A database that fails (refused, reset, gone mid-transaction) is not the message's fault: the job
stops and hands every delivery back with ``outage`` set, and nothing is counted against them.
A handler's exception is the message's fault only when the database still answers afterwards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from app import tracing
from app.consumer import inbox
from app.consumer.inbox import BatchHandler, Handler, Message

log = logging.getLogger("app.consumer")


@dataclass(eq=False)
class Held:
    """A delivery the kit holds, and what is known of its attempts."""

    tag: int
    message: Message
    redelivered: bool = False
    #: this try's attempt is already counted in the attempts table
    charged: bool = False
    attempts: int = 0
    #: a handler error (or timeout) still to be recorded before anything else
    failure: str | None = None
    #: a commit of this delivery's effect whose outcome was not learned (the connection broke)
    maybe_committed: bool = False
    #: a quorum queue's ``x-delivery-count``: how often the broker had this message back
    #: (requeued, or its consumer's channel gone) before this delivery; 0 elsewhere
    broker_count: int = 0
    #: dead-lettered because ``broker_count`` reached the kit's ``broker_delivery_limit``
    broker_limited: bool = False

    @property
    def message_id(self) -> str:
        return self.message.message_id


class Window:
    """Deliveries given to one job. The handler thread takes them one by one; the event loop may
    cut the window (the deliveries not yet taken go to another job) or abandon it (a handler ran
    past its timeout: the job must not commit)."""

    def __init__(self, items: list[Held], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.items = items
        self.clock = clock
        self.created = clock()
        self._lock = threading.Lock()
        self._next = 0
        self._cut = False
        self._abandoned = False
        self._committing = False
        #: the delivery whose handler runs now, and since when
        self.running: tuple[Held, float] | None = None
        self.dbapi_connection: Any = None

    def take_all(self) -> list[Held]:
        """Every delivery at once (a batch handler's window): running from now, as one."""
        with self._lock:
            if self._cut or self._abandoned or self._next >= len(self.items):
                return []
            taken = self.items[self._next :]
            self._next = len(self.items)
            self.running = (taken[0], self.clock())
            return taken

    def take(self) -> Held | None:
        with self._lock:
            if self._cut or self._abandoned or self._next >= len(self.items):
                self.running = None
                return None
            held = self.items[self._next]
            self._next += 1
            self.running = (held, self.clock())
            return held

    def done_running(self) -> None:
        with self._lock:
            self.running = None

    def cut(self) -> list[Held]:
        """The deliveries not taken yet; the job takes no more."""
        with self._lock:
            self._cut = True
            rest, self.items = self.items[self._next :], self.items[: self._next]
            return rest

    def untaken(self) -> list[Held]:
        with self._lock:
            return self.items[self._next :]

    def abandon(self) -> bool:
        """The job must not commit (a handler timed out). False when it is committing already."""
        with self._lock:
            if self._committing:
                return False
            self._abandoned = True
        return True

    def cancel_statement(self) -> None:
        """psycopg: end a statement the (abandoned) handler waits on. Blocks: a thread's job."""
        cancel = getattr(self.dbapi_connection, "cancel", None)
        if callable(cancel):
            try:
                cancel()
            except Exception:  # best effort; it rolls back when it returns
                log.debug("cancelling an abandoned handler's statement failed", exc_info=True)

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def begin_commit(self) -> bool:
        with self._lock:
            if self._abandoned:
                return False
            self._committing = True
            return True


@dataclass
class Outcome:
    """What a job did with its window's deliveries."""

    handled: list[Held] = field(default_factory=list)
    deduplicated: list[Held] = field(default_factory=list)
    #: to run again (the others of a window whose handler failed, deliveries cut off, an outage)
    again: list[Held] = field(default_factory=list)
    #: to run again one message per transaction (a window failed and no handler raised)
    isolate: list[Held] = field(default_factory=list)
    #: handler failed: its ``failure`` is set; recorded by a later :func:`run_single`
    failed: list[Held] = field(default_factory=list)
    #: failures recorded: requeue these
    requeue: list[Held] = field(default_factory=list)
    #: reached the delivery limit: dead-letter these (the reason in their ``failure``)
    dead: list[Held] = field(default_factory=list)
    #: the database failed: the error, and every undecided delivery is in ``again``
    outage: BaseException | None = None
    abandoned: bool = False
    #: time spent in handlers that returned (sizes the next windows)
    handler_seconds: float = 0.0


def _is_disconnect(exc: BaseException) -> bool:
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def _still_answers(conn: Connection) -> bool:
    """After a handler's exception: roll back and ask the database a trivial question."""
    try:
        conn.rollback()
        conn.exec_driver_sql("SELECT 1")
        conn.rollback()
    except Exception:  # any failure here means the database is not usable
        return False
    return True


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---------------------------------------------------------------- a window, one transaction


def handle(handler: Handler, message: Message, conn: Connection) -> None:
    """Run ``handler`` on one message, inside a span that continues the message's trace (its
    ``traceparent`` header) when OpenTelemetry is installed; just the call without it."""
    with tracing.consumer_span(
        message.headers,
        name=f"{message.exchange or '(default)'} process",
        attributes={
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "process",
            "messaging.message.id": message.message_id,
            "messaging.destination.name": message.exchange,
            "messaging.rabbitmq.destination.routing_key": message.routing_key,
        },
    ):
        handler(message, conn)


def handle_batch(handler: BatchHandler, messages: list[Message], conn: Connection) -> None:
    """Run a batch handler inside one span linked to each message's trace (with
    OpenTelemetry and at least one ``traceparent``; just the call without)."""
    with tracing.linked_span(
        [m.headers for m in messages],
        name="outbox batch process",
        attributes={"messaging.system": "rabbitmq", "messaging.operation.type": "process"},
    ):
        handler(messages, conn)


def run_window(
    engine: Engine,
    *,
    consumer: str,
    window: Window,
    handler: Handler,
    batch_handler: BatchHandler | None = None,
) -> Outcome:
    """Handlers first, then the inbox rows of the window in one ``INSERT … ON CONFLICT DO
    NOTHING``: an id it did not insert had its effect already (a duplicate publish; redeliveries
    run alone and ask the inbox first), so the window is rolled back and run again without it.
    No ``SELECT`` before: first deliveries are new, and a lookup of 100 ids was the window's
    dearest statement on a table whose statistics lag its growth."""
    out = Outcome()
    try:
        conn = engine.connect()
    except Exception as exc:  # refused, reset, pool timeout: the database
        out.outage, out.again = exc, list(window.items)
        return out
    with conn:
        window.dbapi_connection = conn.connection.dbapi_connection
        taken: list[Held] = []
        new: dict[str, Held] = {}
        try:
            conn.begin()
        except Exception as exc:
            out.outage, out.again = exc, list(window.items)
            return out
        if batch_handler is not None:
            taken = window.take_all()
            for item in taken:
                if item.message_id in new:
                    out.deduplicated.append(item)
                else:
                    new[item.message_id] = item
            started = time.perf_counter()
            try:
                if new:
                    handle_batch(batch_handler, [h.message for h in new.values()], conn)
            except Exception as exc:  # one message of them: find it one by one
                window.done_running()
                out.deduplicated.clear()
                return _window_failed(conn, window, out, taken, None, exc)
            out.handler_seconds += time.perf_counter() - started
        while (held := window.take()) is not None:
            taken.append(held)
            if held.message_id in new:  # the same message twice in one window
                out.deduplicated.append(held)
                continue
            started = time.perf_counter()
            try:
                handle(handler, held.message, conn)
            except Exception as exc:  # the handler's, classified below
                window.done_running()
                out.deduplicated.clear()
                return _window_failed(conn, window, out, taken, held, exc)
            out.handler_seconds += time.perf_counter() - started
            new[held.message_id] = held
        window.done_running()
        rest = window.untaken()
        try:
            inserted = inbox.record(conn, consumer=consumer, message_ids=new)
        except Exception as exc:
            out.deduplicated.clear()
            return _window_failed(conn, window, out, taken, None, exc)
        if len(inserted) < len(new):
            # some had their effect already: undo this window's, run the others again
            conn.rollback()
            out.deduplicated = [h for h in new.values() if h.message_id not in inserted]
            again = set(map(id, out.deduplicated))
            out.again = [h for h in taken if id(h) not in again] + rest
            return out
        if not window.begin_commit():
            conn.rollback()
            out.deduplicated.clear()
            out.abandoned, out.again = True, taken + rest
            return out
        try:
            conn.commit()
        except Exception as exc:  # the outcome is unknown: the inbox will tell
            for held in taken:
                held.maybe_committed = True
            out.deduplicated.clear()
            out.outage, out.again = exc, taken + rest
            return out
        out.handled = list(new.values())
        out.again = rest
        return out


def _window_failed(
    conn: Connection,
    window: Window,
    out: Outcome,
    taken: list[Held],
    culprit: Held | None,
    exc: Exception,
) -> Outcome:
    others = [h for h in taken if h is not culprit] + window.untaken()
    if window.abandoned:
        conn.invalidate()
        out.abandoned, out.again = True, [*others, *([culprit] if culprit else [])]
        return out
    if _is_disconnect(exc) or not _still_answers(conn):
        out.outage, out.again = exc, [*([culprit] if culprit else []), *others]
        return out
    if culprit is None and len(taken) == 1:
        culprit, others = taken[0], window.untaken()
    if culprit is None:
        # a statement of the kit's failed while the database answers (a handler swallowed
        # an error and left the transaction aborted, say): find the message one by one
        out.isolate = others
        return out
    culprit.failure = _describe(exc)
    out.failed.append(culprit)
    out.again = others
    return out


# ---------------------------------------------------------------- one message alone


def run_single(
    engine: Engine,
    *,
    consumer: str,
    window: Window,
    handler: Handler,
    limit: int,
    charge: bool,
    broker_limit: int | None = None,
) -> Outcome:
    """One delivery (the window's only item): record a pending failure, or charge the attempt
    (``charge``: a redelivery, whose earlier try may have killed the process), then the inbox
    row, the handler and ``COMMIT``."""
    out = Outcome()
    held = window.items[0]
    try:
        conn = engine.connect()
    except Exception as exc:
        out.outage, out.again = exc, [held]
        return out
    with conn:
        window.dbapi_connection = conn.connection.dbapi_connection
        try:
            if held.failure is not None:
                return _record_failure(conn, consumer=consumer, held=held, limit=limit, out=out)
            if (
                charge
                and not held.charged
                and not _charge(conn, consumer, held, limit, out, broker_limit=broker_limit)
            ):
                return out
        except Exception as exc:
            out.outage, out.again = exc, [held]
            return out
        return _run_alone(
            conn, consumer=consumer, window=window, handler=handler, limit=limit, out=out
        )


def _charge(
    conn: Connection,
    consumer: str,
    held: Held,
    limit: int,
    out: Outcome,
    *,
    broker_limit: int | None = None,
) -> bool:
    """Count the attempt about to start, committed before the handler runs. False when the
    delivery is decided already (done before, past its limit, or returned by the broker
    ``broker_limit`` times: dead)."""
    with conn.begin():
        if inbox.already_in(conn, consumer=consumer, message_ids=[held.message_id]):
            out.deduplicated.append(held)
            return False
        if broker_limit is not None and held.broker_count >= broker_limit:
            # the broker's own count (a quorum queue's x-delivery-count), which sees tries our
            # table cannot (another consumer name, kits killed before their charge committed)
            inbox.forget(conn, consumer=consumer, message_ids=[held.message_id])
            held.broker_limited = True
            held.failure = (
                f"broker delivery limit {broker_limit} reached: the broker returned "
                f"it {held.broker_count} times (x-delivery-count)"
            )
            out.dead.append(held)
            return False
        count = inbox.charge(conn, consumer=consumer, message_id=held.message_id)
        before = count - 1
        if before >= limit:
            error = inbox.last_error(conn, consumer=consumer, message_id=held.message_id)
            inbox.forget(conn, consumer=consumer, message_ids=[held.message_id])
    held.charged, held.attempts = True, count - 1
    if before >= limit:
        held.attempts = before
        held.failure = f"delivery limit {limit} reached: {before} attempts, the last " + (
            f"failed: {error}"
            if error
            else "ended without an outcome (the consumer died "
            "or lost its database while the handler ran)"
        )
        out.dead.append(held)
        return False
    return True


def _record_failure(
    conn: Connection, *, consumer: str, held: Held, limit: int, out: Outcome
) -> Outcome:
    error = held.failure or "failed"
    with conn.begin():
        if held.charged:
            count = inbox.note_error(
                conn, consumer=consumer, message_id=held.message_id, error=error
            )
        else:
            count = inbox.charge(conn, consumer=consumer, message_id=held.message_id, error=error)
        if count >= limit:
            inbox.forget(conn, consumer=consumer, message_ids=[held.message_id])
    held.attempts, held.charged = count, False
    if count >= limit:
        held.failure = f"delivery limit {limit} reached: {count} attempts, the last failed: {error}"
        out.dead.append(held)
    else:
        held.failure = None
        out.requeue.append(held)
    return out


def _run_alone(
    conn: Connection, *, consumer: str, window: Window, handler: Handler, limit: int, out: Outcome
) -> Outcome:
    held = window.take()
    if held is None:  # abandoned before it started
        out.abandoned, out.again = True, list(window.items)
        return out
    try:
        conn.begin()
        if not inbox.record(conn, consumer=consumer, message_ids=[held.message_id]):
            window.done_running()
            conn.rollback()
            out.deduplicated.append(held)
            return out
    except Exception as exc:
        window.done_running()
        out.outage, out.again = exc, [held]
        return out
    try:
        handle(handler, held.message, conn)
    except Exception as exc:  # the handler's, classified below
        window.done_running()
        if window.abandoned:
            conn.invalidate()
            out.abandoned, out.again = True, [held]
        elif _is_disconnect(exc) or not _still_answers(conn):
            out.outage, out.again = exc, [held]
        else:
            held.failure = _describe(exc)
            try:
                return _record_failure(conn, consumer=consumer, held=held, limit=limit, out=out)
            except Exception as exc2:
                out.outage, out.again = exc2, [held]
        return out
    window.done_running()
    try:
        if held.charged or held.attempts:
            inbox.forget(conn, consumer=consumer, message_ids=[held.message_id])
        if not window.begin_commit():
            conn.rollback()
            out.abandoned, out.again = True, [held]
            return out
        conn.commit()
    except Exception as exc:  # the outcome of COMMIT is unknown: the inbox tells
        held.maybe_committed = True
        out.outage, out.again = exc, [held]
        return out
    out.handled.append(held)
    return out
