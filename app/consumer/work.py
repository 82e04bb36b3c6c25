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
import time
from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from app import tracing
from app.consumer import inbox
from app.consumer.config import ConsumerConfig
from app.consumer.core import broker_verdict, limit_verdict
from app.consumer.held import Held, Outcome, Window
from app.consumer.inbox import BatchHandler, Handler, Message

log = logging.getLogger("app.consumer")


@dataclass(frozen=True, kw_only=True)
class Jobs:
    """What every job of one consumer runs with; :meth:`run` is the job the core's
    :class:`~app.consumer.core.Start` asks for."""

    engine: Engine
    config: ConsumerConfig
    handler: Handler
    batch_handler: BatchHandler | None = None

    @property
    def consumer(self) -> str:
        return self.config.name

    def run(self, lane: str, window: Window) -> Outcome:
        """``window``: a window in one transaction; ``single``/``suspect``: its message alone
        (a ``suspect``, redelivered, is charged before its handler runs)."""
        if lane == "window":
            return run_window(self, window)
        return run_single(self, window, charge=lane == "suspect")


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


def run_window(jobs: Jobs, window: Window) -> Outcome:
    """Handlers first, then the inbox rows of the window in one ``INSERT … ON CONFLICT DO
    NOTHING``: an id it did not insert had its effect already (a duplicate publish; redeliveries
    run alone and ask the inbox first), so the window is rolled back and run again without it.
    No ``SELECT`` before: first deliveries are new, and a lookup of 100 ids was the window's
    dearest statement on a table whose statistics lag its growth."""
    out = Outcome()
    try:
        conn = jobs.engine.connect()
    except Exception as exc:  # refused, reset, pool timeout: the database
        out.outage, out.again = exc, list(window.items)
        return out
    with conn:
        window.dbapi_connection = conn.connection.dbapi_connection
        try:
            conn.begin()
        except Exception as exc:
            out.outage, out.again = exc, list(window.items)
            return out
        tx = _WindowTx(jobs=jobs, conn=conn, window=window, out=out)
        failed = _run_handlers(tx)
        return failed if failed is not None else _commit_window(tx)


@dataclass
class _WindowTx:
    """A window's transaction under way: the deliveries taken, the new messages, the outcome."""

    jobs: Jobs
    conn: Connection
    window: Window
    out: Outcome
    taken: list[Held] = field(default_factory=list)
    new: dict[str, Held] = field(default_factory=dict)


def _run_handlers(tx: _WindowTx) -> Outcome | None:
    """The handler of each message the window gives (or the batch handler once for them all);
    the window's outcome when a handler raised."""
    window, out, taken, new = tx.window, tx.out, tx.taken, tx.new
    if tx.jobs.batch_handler is not None:
        taken.extend(window.take_all())
        for item in taken:
            if item.message_id in new:
                out.deduplicated.append(item)
            else:
                new[item.message_id] = item
        started = time.perf_counter()
        try:
            if new:
                handle_batch(tx.jobs.batch_handler, [h.message for h in new.values()], tx.conn)
        except Exception as exc:  # one message of them: find it one by one
            window.done_running()
            out.deduplicated.clear()
            return _window_failed(tx.conn, window, out, taken, None, exc)
        out.handler_seconds += time.perf_counter() - started
    while (held := window.take()) is not None:
        taken.append(held)
        if held.message_id in new:  # the same message twice in one window
            out.deduplicated.append(held)
            continue
        started = time.perf_counter()
        try:
            handle(tx.jobs.handler, held.message, tx.conn)
        except Exception as exc:  # the handler's, classified below
            window.done_running()
            out.deduplicated.clear()
            return _window_failed(tx.conn, window, out, taken, held, exc)
        out.handler_seconds += time.perf_counter() - started
        new[held.message_id] = held
    window.done_running()
    return None


def _commit_window(tx: _WindowTx) -> Outcome:
    """The window's inbox rows, then ``COMMIT`` (unless it was abandoned meanwhile)."""
    conn, window, out, taken, new = tx.conn, tx.window, tx.out, tx.taken, tx.new
    rest = window.untaken()
    try:
        inserted = inbox.record(conn, consumer=tx.jobs.consumer, message_ids=new)
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
        for held in new.values():  # not a second copy in the window: that one is a duplicate
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


def run_single(jobs: Jobs, window: Window, *, charge: bool) -> Outcome:
    """One delivery (the window's only item): record a pending failure, or charge the attempt
    (``charge``: a redelivery, whose earlier try may have killed the process), then the inbox
    row, the handler and ``COMMIT``."""
    out = Outcome()
    held = window.items[0]
    consumer, limit = jobs.consumer, jobs.config.delivery_limit
    try:
        conn = jobs.engine.connect()
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
                and not _charge(
                    conn, consumer, held, limit, out, broker_limit=jobs.config.broker_delivery_limit
                )
            ):
                return out
        except Exception as exc:
            out.outage, out.again = exc, [held]
            return out
        return _run_alone(
            conn, consumer=consumer, window=window, handler=jobs.handler, limit=limit, out=out
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
        verdict = broker_verdict(held.broker_count, broker_limit)
        if verdict is not None:
            # the broker's own count (a quorum queue's x-delivery-count), which sees tries our
            # table cannot (another consumer name, kits killed before their charge committed)
            inbox.forget(conn, consumer=consumer, message_ids=[held.message_id])
            held.broker_limited, held.failure = True, verdict
            out.dead.append(held)
            return False
        before = inbox.charge(conn, consumer=consumer, message_id=held.message_id) - 1
        if before >= limit:
            error = inbox.last_error(conn, consumer=consumer, message_id=held.message_id)
            inbox.forget(conn, consumer=consumer, message_ids=[held.message_id])
            verdict = limit_verdict(before, limit, error)
    held.charged, held.attempts = True, before
    if verdict is not None:
        held.failure = verdict
        out.dead.append(held)
        return False
    return True


def _record_failure(
    conn: Connection, *, consumer: str, held: Held, limit: int, out: Outcome
) -> Outcome:
    """Count the failed try (with its error): requeue it, or dead-letter it at the limit."""
    error = held.failure or "failed"
    with conn.begin():
        if inbox.already_in(conn, consumer=consumer, message_ids=[held.message_id]):
            # its effect is done (a COMMIT whose reply was lost, then a window run again
            # whose handler failed on it): the message is not charged, and it is acked
            held.failure = None
            out.deduplicated.append(held)
            return out
        if held.charged:
            count = inbox.note_error(
                conn, consumer=consumer, message_id=held.message_id, error=error
            )
        else:
            count = inbox.charge(conn, consumer=consumer, message_id=held.message_id, error=error)
        if count >= limit:
            inbox.forget(conn, consumer=consumer, message_ids=[held.message_id])
    held.attempts, held.charged = count, False
    verdict = limit_verdict(count, limit, error)
    if verdict is not None:
        held.failure = verdict
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
