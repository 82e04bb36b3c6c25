"""Messages: one row with every field (its body only when asked), its recorded events, and a
page of rows matching a scope within a byte budget (``/v1/messages``, ``outbox message``, the
console's messages pages).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Engine, Text, and_, cast, func, literal, select

from app.outbox.read.scopes import scope_conditions
from app.outbox.read.sql import as_dict
from app.outbox.schema import SETTLEMENT_COLUMNS, events, outbox
from app.outbox.scope import Scope
from app.outbox.shown import (
    MAX_SHOWN_DOCUMENT,
    MAX_SHOWN_TEXT,
    body_of,
    capped_length,
    document_of,
    marked,
    text_of,
)
from app.outbox.states import Status


@dataclass(frozen=True, slots=True)
class MessageRecord:
    """One outbox row, every field; ``body`` only when asked for."""

    id: int
    message_id: str
    batch_id: str
    exchange: str
    routing_key: str
    mandatory: bool
    content_type: str | None
    headers: dict[str, Any] | None
    properties: dict[str, Any] | None
    ordering_key: str | None
    status: Status
    attempts: int
    max_attempts: int
    nacks: int
    lost_confirms: int
    available_at: dt.datetime
    not_before: dt.datetime | None
    lease_owner: str | None
    lease_until: dt.datetime | None
    claimed_at: dt.datetime | None
    channel_id: int | None
    delivery_tag: int | None
    created_at: dt.datetime
    published_at: dt.datetime | None
    confirmed_at: dt.datetime | None
    last_error: str | None
    reply_code: int | None
    reply_text: str | None
    body_size: int
    body: bytes | None
    #: a RabbitMQ stream's row: its stream (``exchange`` and ``routing_key`` are empty) and its
    #: publishing id, given at its first claim and kept until it is settled
    stream: str | None = None
    stream_seq: int | None = None

    @property
    def delivery(self) -> str:
        """How often the broker may hold it: a stream drops a repeated publishing id."""
        return "exactly once" if self.stream is not None else "at least once"

    @property
    def destination(self) -> str:
        """Where it goes, in words: its stream (with its publishing id), or its exchange."""
        if self.stream is None:
            return f"exchange {self.exchange!r}, routing key {self.routing_key!r}"
        seq = (
            "no publishing id yet"
            if self.stream_seq is None
            else f"publishing id {self.stream_seq}"
        )
        return f"stream {self.stream!r}, {seq}"


#: Text columns a reader sees cut at :data:`~app.outbox.shown.MAX_SHOWN_TEXT` characters.
_SHOWN_TEXT = (
    "message_id",
    "batch_id",
    "exchange",
    "routing_key",
    "stream",
    "content_type",
    "ordering_key",
    "lease_owner",
    "last_error",
    "reply_text",
)


def _message_columns() -> list[Any]:
    """Every column but the body, each bounded (:mod:`app.outbox.shown`): JSON columns are
    read as text only when short enough, then decoded with bounds (``content.load_document``),
    so a hostile document shows as unreadable and never fails the request."""
    cols: list[Any] = []
    for c in outbox.c:
        if c.name in ("headers", "properties"):
            cols += document_of(c)
        elif c.name in _SHOWN_TEXT:
            cols += text_of(c)
        elif c.name != "body" and c.name not in SETTLEMENT_COLUMNS:
            cols.append(c)
    return cols


_MESSAGE_COLUMNS = _message_columns()


def message(
    engine: Engine,
    *,
    message_id: str,
    include_body: bool = False,
    body_limit: int | None = None,
) -> MessageRecord | None:
    """One row by its message id; its body only with ``include_body``, and then at most
    ``body_limit`` bytes of it (``body_size`` is the whole body's)."""
    cols = [*_MESSAGE_COLUMNS, func.length(outbox.c.body).label("body_size")]
    if include_body:
        cols.append(body_of(outbox.c.body, limit=body_limit))
    stmt = select(*cols).where(outbox.c.message_id == message_id)
    with engine.connect() as conn:
        row = conn.execute(stmt).mappings().first()
    if row is None:
        return None
    values = marked(row)
    values["body"] = bytes(values["body"]) if include_body else None
    values["status"] = Status(values["status"])
    values["headers"] = as_dict(values["headers"])
    values["properties"] = as_dict(values["properties"])
    return MessageRecord(**values)


@dataclass(frozen=True, slots=True)
class MessageEvent:
    """A rare fact of a message's life (``outbox_events``), as recorded when it happened."""

    id: int
    at: dt.datetime
    kind: str
    from_status: str | None
    attempt: int
    reply_code: int | None
    detail: str | None
    actor: str | None
    audit_id: int | None


def message_events(engine: Engine, *, outbox_id: int, limit: int = 200) -> list[MessageEvent]:
    """The message's recorded events, oldest first (the last ``limit`` of them)."""
    cols: list[Any] = []
    for name in MessageEvent.__slots__:
        cols += text_of(events.c[name]) if name in ("detail", "actor") else [events.c[name]]
    stmt = select(*cols).where(events.c.outbox_id == outbox_id).order_by(events.c.id.desc())
    with engine.connect() as conn:
        rows = conn.execute(stmt.limit(limit)).mappings().all()
    return [MessageEvent(**marked(row)) for row in reversed(rows)]


#: What an operator searches messages by (all given conditions hold): the same value a
#: republish of the search's failures is scoped by.
MessageFilter = Scope


MAX_PAGE_BYTES = 4 * 1024 * 1024
#: What a row costs beyond its documents and reasons (ids, names, times, JSON keys).
ROW_OVERHEAD_BYTES = 1024


@dataclass(frozen=True, slots=True)
class MessageSlice:
    """A page of messages; ``truncated``: it stopped at the byte budget before ``limit`` rows."""

    items: list[MessageRecord]
    truncated: bool


def _row_bytes() -> ColumnElement[int]:
    """Characters of a row's variable-size text as a reader is shown it (each value cut as
    :mod:`app.outbox.shown` cuts it): what the row weighs in a page."""
    total: ColumnElement[int] = literal(ROW_OVERHEAD_BYTES)
    for name in ("headers", "properties"):
        total = total + capped_length(cast(outbox.c[name], Text), MAX_SHOWN_DOCUMENT)
    for name in _SHOWN_TEXT:
        total = total + capped_length(outbox.c[name], MAX_SHOWN_TEXT)
    return total


def within_budget(sizes: Sequence[int], *, max_bytes: int) -> int:
    """How many rows of these sizes a page holds: those within ``max_bytes``, at least one."""
    used = 0
    for taken, size in enumerate(sizes):
        used += size
        if used > max_bytes:
            return max(1, taken)
    return len(sizes)


def search_messages(
    engine: Engine,
    *,
    flt: MessageFilter,
    limit: int = 50,
    after: int | None = None,
    max_bytes: int = MAX_PAGE_BYTES,
) -> MessageSlice:
    """Messages matching ``flt`` in id order, without bodies (keyset pages: ``after`` the last
    id of the previous page), at most ``limit`` rows and about ``max_bytes`` of text: the rows'
    sizes are read first, and only the rows within the budget are read in full."""
    conds = scope_conditions(flt)
    if after is not None:
        conds.append(outbox.c.id > after)
    # ORDER BY id + 0, not id: with ``ORDER BY id LIMIT n`` PostgreSQL walks the primary key
    # and filters, guessing that matches are spread evenly; failures or a time range are not,
    # and that walk read 900,000 rows of a 1,000,000-row outbox to find 50. Ordered by an
    # expression, the matches are found by the index of the scope (a status's partial index, a
    # batch, a time range) and the top ``limit`` kept: the cost of the matches, never the table.
    sizes = select(outbox.c.id, _row_bytes().label("size")).order_by(outbox.c.id + 0).limit(limit)
    if conds:
        sizes = sizes.where(and_(*conds))
    with engine.connect() as conn:
        measured = conn.execute(sizes).all()
        taken = within_budget([int(m.size) for m in measured], max_bytes=max_bytes)
        ids = [m.id for m in measured[:taken]]
        cols = [*_MESSAGE_COLUMNS, func.length(outbox.c.body).label("body_size")]
        rows = (
            conn.execute(select(*cols).where(outbox.c.id.in_(ids)).order_by(outbox.c.id))
            .mappings()
            .all()
            if ids
            else []
        )
    out = []
    for row in rows:
        values = marked(row)
        values.update(
            body=None,
            status=Status(values["status"]),
            headers=as_dict(values["headers"]),
            properties=as_dict(values["properties"]),
        )
        out.append(MessageRecord(**values))
    return MessageSlice(items=out, truncated=taken < len(measured))
