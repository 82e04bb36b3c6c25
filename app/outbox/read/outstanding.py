"""Outstanding confirms: the in-flight rows with their channel, delivery tag, attempt and
age, oldest publish first, keyset paginated (``GET /v1/confirms/outstanding``,
``outbox outstanding``, the console's outstanding page).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Engine, and_, case, or_, select

from app.outbox.read.cursors import MAX_ROW_ID, BadCursor, Page, decode_cursor, encode_cursor
from app.outbox.read.figures import age_seconds
from app.outbox.read.sql import from_row, held_since, sent_at
from app.outbox.schema import outbox
from app.outbox.shown import marked, text_of
from app.outbox.states import Status


@dataclass(frozen=True, slots=True)
class OutstandingFilter:
    publisher: str | None = None
    exchange: str | None = None
    batch_id: str | None = None
    min_age_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class OutstandingKey:
    """Keyset position: rows not yet sent (``sent_at`` None) first by id, then by (sent_at, id)."""

    sent_at: dt.datetime | None
    id: int

    def encode(self) -> str:
        sent = self.sent_at.isoformat() if self.sent_at else None
        return encode_cursor({"k": "outstanding", "s": sent, "i": self.id})

    @classmethod
    def decode(cls, cursor: str) -> OutstandingKey:
        payload = decode_cursor(cursor)
        sent, row_id = payload.get("s"), payload.get("i")
        if payload.get("k") != "outstanding" or type(row_id) is not int:
            raise BadCursor("not a cursor returned by this endpoint")
        if not 0 <= row_id <= MAX_ROW_ID:
            raise BadCursor("not a cursor returned by this endpoint")
        if sent is None:
            return cls(sent_at=None, id=row_id)
        try:
            stamp = dt.datetime.fromisoformat(sent) if isinstance(sent, str) else None
            utc = stamp.astimezone(dt.UTC) if stamp and stamp.tzinfo else None
        except (ValueError, OverflowError):
            utc = None
        if utc is None:
            raise BadCursor("not a cursor returned by this endpoint")
        return cls(sent_at=utc, id=row_id)


@dataclass(frozen=True, slots=True)
class OutstandingConfirm:
    """An in-flight row: claimed by ``publisher``; sent when it has a channel and delivery tag."""

    id: int
    message_id: str
    batch_id: str
    publisher: str
    channel_id: int | None
    delivery_tag: int | None
    attempt: int
    max_attempts: int
    exchange: str
    routing_key: str
    published_at: dt.datetime | None
    claimed_at: dt.datetime | None
    age_seconds: float | None
    lease_until: dt.datetime
    lost_confirms: int


def _outstanding_where(
    flt: OutstandingFilter, *, now: dt.datetime, after: OutstandingKey | None
) -> ColumnElement[bool]:
    sent = sent_at()
    cond: ColumnElement[bool] = outbox.c.status == Status.IN_FLIGHT
    if flt.publisher is not None:
        cond = and_(cond, outbox.c.lease_owner == flt.publisher)
    if flt.exchange is not None:
        cond = and_(cond, outbox.c.exchange == flt.exchange)
    if flt.batch_id is not None:
        cond = and_(cond, outbox.c.batch_id == flt.batch_id)
    if flt.min_age_seconds is not None:
        cond = and_(cond, held_since() <= now - dt.timedelta(seconds=flt.min_age_seconds))
    if after is None:
        return cond
    if after.sent_at is None:
        return and_(cond, or_(and_(sent.is_(None), outbox.c.id > after.id), sent.is_not(None)))
    later = or_(sent > after.sent_at, and_(sent == after.sent_at, outbox.c.id > after.id))
    return and_(cond, sent.is_not(None), later)


#: The names an outstanding confirm shows, each cut (:mod:`app.outbox.shown`).
_OUTSTANDING_NAMES = ("message_id", "batch_id", "lease_owner", "exchange", "routing_key")


def outstanding_confirms(
    engine: Engine,
    *,
    now: dt.datetime,
    flt: OutstandingFilter,
    limit: int,
    after: OutstandingKey | None = None,
) -> Page[OutstandingConfirm]:
    """In-flight rows, oldest publish first (claimed-but-unsent rows lead), keyset paginated."""
    sent = sent_at().label("sent_at")
    shown = [*(text_of(outbox.c[n]) for n in _OUTSTANDING_NAMES)]
    plain = [c for c in outbox.c if c.name not in _OUTSTANDING_NAMES and c.name != "body"]
    stmt = (
        select(*plain, *(c for pair in shown for c in pair), sent)
        .where(_outstanding_where(flt, now=now, after=after))
        .order_by(case((sent_at().is_(None), 0), else_=1), sent_at(), outbox.c.id)
        .limit(limit + 1)
    )
    with engine.connect() as conn:
        rows = [marked(r) for r in conn.execute(stmt).mappings().all()]
    items = [_outstanding(row, now) for row in rows[:limit]]
    cursor = None
    if len(rows) > limit:
        last = items[-1]
        cursor = OutstandingKey(sent_at=last.published_at, id=last.id).encode()
    return Page(items=items, next_cursor=cursor)


def _outstanding(row: Any, now: dt.datetime) -> OutstandingConfirm:
    return from_row(
        OutstandingConfirm,
        row,
        publisher=row["lease_owner"],
        attempt=row["attempts"],
        published_at=row["sent_at"],
        age_seconds=age_seconds(row["sent_at"] or row["claimed_at"], now),
    )
