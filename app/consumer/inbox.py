"""The inbox: a message's effect happens once per consumer.

:func:`handle_once` runs in one database transaction: it records ``(consumer, message_id)`` in
``outbox_inbox`` and runs the handler with that transaction's connection, so the handler's own
writes and the inbox row commit together, or neither does. A message already in the inbox (a
redelivery after a lost ack, a duplicate publish after a lost confirm) is not handled again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from app.outbox.schema import inbox


@dataclass(frozen=True, slots=True)
class Message:
    """What a handler sees of a delivery (no broker object crosses into the handler's thread)."""

    message_id: str
    body: bytes
    routing_key: str
    exchange: str
    headers: Mapping[str, Any] = field(default_factory=dict)
    content_type: str | None = None
    redelivered: bool = False
    #: ``x-delivery-count`` of a quorum queue, else the kit's own count of failed attempts
    delivery_count: int = 0


#: A handler: does the message's effect with ``conn`` (the kit's transaction). Raising rolls the
#: transaction back (the inbox row too) and the delivery goes to the failure policy.
Handler = Callable[[Message, Connection], None]


def handle_once(engine: Engine, *, consumer: str, message: Message, handler: Handler) -> bool:
    """Record the message in the inbox and run ``handler`` in the same transaction. False when
    the message was already there (the handler did not run)."""
    table = inbox
    values = {"consumer": consumer, "message_id": message.message_id,
              "received_at": dt.datetime.now(dt.UTC)}  # fmt: skip
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    stmt = (
        dialect.insert(table).values(**values).on_conflict_do_nothing()
        .returning(table.c.message_id)  # rowcount is not reliable here (psycopg answers -1)
    )  # fmt: skip
    with engine.begin() as conn:
        if conn.execute(stmt).first() is None:
            return False
        handler(message, conn)
    return True


def seen(engine: Engine, *, consumer: str, message_id: str) -> bool:
    stmt = select(inbox.c.message_id).where(
        inbox.c.consumer == consumer, inbox.c.message_id == message_id
    )
    with engine.connect() as conn:
        return conn.execute(stmt).first() is not None


def purge_inbox(engine: Engine, *, older_than: dt.timedelta, chunk: int = 1000) -> int:
    """Forget inbox rows older than ``older_than`` (longer than any redelivery or republish can
    come late), ``chunk`` rows per transaction."""
    cutoff = dt.datetime.now(dt.UTC) - older_than
    total = 0
    while True:
        old = select(inbox.c.consumer, inbox.c.message_id).where(inbox.c.received_at < cutoff)
        with engine.begin() as conn:
            rows = conn.execute(old.limit(chunk)).all()
            for consumer, message_id in rows:
                conn.execute(delete(inbox).where(inbox.c.consumer == consumer,
                                                 inbox.c.message_id == message_id))  # fmt: skip
        total += len(rows)
        if len(rows) < chunk:
            return total
