"""The inbox and the attempts: a message's effect happens once per consumer, and a message that
keeps failing (or keeps killing its process) is counted durably.

- ``outbox_inbox (consumer, message_id)``: written in the same transaction as the handler's own
  writes, so the effect and the record of it commit together, or neither does. A message already
  there (a redelivery after a lost ack, a duplicate publish after a lost confirm) is not handled
  again.
- ``outbox_consumer_attempts``: how often a message's handler started without an outcome. Written
  (and committed) before a redelivered message's handler runs, and when a handler raises; deleted
  in the transaction of the message's effect, or when the message is dead-lettered.

Every function here runs in a handler thread, on a connection of its own.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, delete, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from app.consumer.held import ERROR_CHARS as ERROR_CHARS
from app.consumer.held import Message as Message
from app.outbox.schema import consumer_attempts, inbox

#: A handler: does the message's effect with ``conn`` (the kit's transaction). Raising rolls the
#: transaction back (the inbox row too) and the delivery goes to the failure policy.
Handler = Callable[[Message, Connection], None]

#: A batch handler: does the effects of a window's messages at once with ``conn`` (one
#: ``executemany``, say). Raising rolls the window back; its messages then run one by one
#: (``[message]``) so that only the one that fails is charged.
BatchHandler = Callable[[Sequence[Message], Connection], None]


def _dialect(conn: Connection | Engine) -> Any:
    return postgresql if conn.dialect.name == "postgresql" else sqlite


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def already_in(conn: Connection, *, consumer: str, message_ids: Iterable[str]) -> set[str]:
    """Which of ``message_ids`` already had their effect."""
    ids = sorted(set(message_ids))
    if not ids:
        return set()
    stmt = select(inbox.c.message_id).where(
        inbox.c.consumer == consumer, inbox.c.message_id.in_(ids)
    )
    return set(conn.execute(stmt).scalars())


#: PostgreSQL: the ids as one array parameter: one statement and one plan whatever the
#: window's size, where a ``VALUES`` list is built, sent and planned anew per row count
_RECORD_PG = text(
    "INSERT INTO outbox_inbox (consumer, message_id, received_at) "
    "SELECT :consumer, m, now() FROM unnest(CAST(:ids AS text[])) AS m ORDER BY m "
    "ON CONFLICT DO NOTHING RETURNING message_id"
)


def record(conn: Connection, *, consumer: str, message_ids: Iterable[str]) -> set[str]:
    """Insert the inbox rows of ``message_ids`` in one statement, in sorted order (two
    transactions inserting overlapping ids then lock them in the same order: no deadlock).
    Returns the ids inserted: an id missing from it was there already, or was committed by
    another transaction meanwhile (this one waited for it on the primary key)."""
    ids = sorted(set(message_ids))
    if not ids:
        return set()
    if conn.dialect.name == "postgresql":
        return set(conn.execute(_RECORD_PG, {"consumer": consumer, "ids": ids}).scalars())
    now = _now()
    stmt = (
        sqlite.insert(inbox)
        .values([{"consumer": consumer, "message_id": m, "received_at": now} for m in ids])
        .on_conflict_do_nothing()
        .returning(inbox.c.message_id)
    )
    return set(conn.execute(stmt).scalars())


def handle_once(engine: Engine, *, consumer: str, message: Message, handler: Handler) -> bool:
    """Record the message in the inbox and run ``handler`` in the same transaction. False when
    the message was already there (the handler did not run)."""
    with engine.begin() as conn:
        if not record(conn, consumer=consumer, message_ids=[message.message_id]):
            return False
        handler(message, conn)
    return True


def seen(engine: Engine, *, consumer: str, message_id: str) -> bool:
    with engine.connect() as conn:
        return bool(already_in(conn, consumer=consumer, message_ids=[message_id]))


# ---------------------------------------------------------------- attempts


def charge(conn: Connection, *, consumer: str, message_id: str, error: str | None = None) -> int:
    """One more attempt of ``message_id`` (an attempt about to start, or one that just failed
    with ``error``); returns the count with it."""
    ins = (
        _dialect(conn)
        .insert(consumer_attempts)
        .values(
            consumer=consumer,
            message_id=message_id,
            attempts=1,
            last_error=_clip(error),
            updated_at=_now(),
        )
    )
    stmt = ins.on_conflict_do_update(
        index_elements=[consumer_attempts.c.consumer, consumer_attempts.c.message_id],
        set_={
            "attempts": consumer_attempts.c.attempts + 1,
            "last_error": ins.excluded.last_error
            if error is not None
            else consumer_attempts.c.last_error,
            "updated_at": ins.excluded.updated_at,
        },
    ).returning(consumer_attempts.c.attempts)
    return int(conn.execute(stmt).scalar_one())


def note_error(conn: Connection, *, consumer: str, message_id: str, error: str) -> int:
    """Keep ``error`` as the outcome of the attempt already charged; returns the count."""
    stmt = (
        update(consumer_attempts)
        .where(
            consumer_attempts.c.consumer == consumer, consumer_attempts.c.message_id == message_id
        )
        .values(last_error=_clip(error), updated_at=_now())
        .returning(consumer_attempts.c.attempts)
    )
    found = conn.execute(stmt).scalar_one_or_none()
    return 1 if found is None else int(found)


def last_error(conn: Connection, *, consumer: str, message_id: str) -> str | None:
    stmt = select(consumer_attempts.c.last_error).where(
        consumer_attempts.c.consumer == consumer, consumer_attempts.c.message_id == message_id
    )
    return conn.execute(stmt).scalar_one_or_none()


def forget(conn: Connection, *, consumer: str, message_ids: Iterable[str]) -> None:
    ids = sorted(set(message_ids))
    if ids:
        table = consumer_attempts
        conn.execute(delete(table).where(table.c.consumer == consumer, table.c.message_id.in_(ids)))


def _clip(error: str | None) -> str | None:
    return None if error is None else error[:ERROR_CHARS]


# ---------------------------------------------------------------- retention


def purge_inbox(engine: Engine, *, older_than: dt.timedelta, chunk: int = 1000) -> int:
    """Forget inbox rows (and attempts rows) older than ``older_than`` (longer than any
    redelivery or republish can come late), ``chunk`` rows per transaction."""
    cutoff = _now() - older_than
    total = 0
    while True:
        old = select(inbox.c.consumer, inbox.c.message_id).where(inbox.c.received_at < cutoff)
        with engine.begin() as conn:
            rows = conn.execute(old.limit(chunk)).all()
            for consumer, message_id in rows:
                conn.execute(
                    delete(inbox).where(
                        inbox.c.consumer == consumer, inbox.c.message_id == message_id
                    )
                )
        total += len(rows)
        if len(rows) < chunk:
            break
    with engine.begin() as conn:
        conn.execute(delete(consumer_attempts).where(consumer_attempts.c.updated_at < cutoff))
    return total


def give_up(conn: Connection, *, consumer: str, message_id: str, attempts: int, error: str) -> None:
    """Keep a message given up (its delivery limit reached) as its attempts row: ``attempts``
    and why, where an operator finds it. For a stream, which has no dead-letter exchange: the
    reader moves past it, and reading it again finds it past its limit (its handler does not
    run again)."""
    ins = (
        _dialect(conn)
        .insert(consumer_attempts)
        .values(
            consumer=consumer,
            message_id=message_id,
            attempts=attempts,
            last_error=_clip(error),
            updated_at=_now(),
        )
    )
    conn.execute(
        ins.on_conflict_do_update(
            index_elements=[consumer_attempts.c.consumer, consumer_attempts.c.message_id],
            set_={"attempts": attempts, "last_error": ins.excluded.last_error},
        )
    )
