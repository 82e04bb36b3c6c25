"""Outstanding confirms: the in-flight rows with their channel, delivery tag, attempt and
age, oldest publish first, keyset paginated (``GET /v1/confirms/outstanding``,
``outbox outstanding``, the console's outstanding page). A stream's row in flight shows its
stream, lane and publishing id instead (it has no channel or tag; app/streams); the lanes
themselves, who holds each and until when, are :func:`list_lanes` (``GET /v1/streams``,
``outbox streams``, the same console page).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Engine, ScalarSelect, and_, case, func, or_, select

from app.outbox.read.cursors import MAX_ROW_ID, BadCursor, Page, decode_cursor, encode_cursor
from app.outbox.read.figures import age_seconds
from app.outbox.read.sql import from_row, held_since, sent_at
from app.outbox.schema import SETTLEMENT_COLUMNS, outbox, stream_lanes
from app.outbox.shown import marked, text_of
from app.outbox.states import Status


@dataclass(frozen=True, slots=True)
class OutstandingFilter:
    publisher: str | None = None
    exchange: str | None = None
    batch_id: str | None = None
    min_age_seconds: float | None = None
    stream: str | None = None


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
    """An in-flight row: claimed by ``publisher``; sent when it has a channel and delivery tag.
    A stream's row has neither: its ``stream``, ``lane`` and publishing id (``stream_seq``,
    given at its claim) say where it goes; ``publisher`` is its lane's holder."""

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
    stream: str | None = None
    #: the stream's lane the row belongs to (``id % lanes``; None before its lanes exist)
    lane: int | None = None
    stream_seq: int | None = None


def _outstanding_where(
    flt: OutstandingFilter, *, now: dt.datetime, after: OutstandingKey | None
) -> ColumnElement[bool]:
    sent = sent_at()
    cond: ColumnElement[bool] = outbox.c.status == Status.IN_FLIGHT
    if flt.publisher is not None:
        cond = and_(cond, outbox.c.lease_owner == flt.publisher)
    if flt.exchange is not None:
        cond = and_(cond, outbox.c.exchange == flt.exchange)
        if flt.stream is None:  # the default exchange's rows (""), not a stream's
            cond = and_(cond, outbox.c.stream.is_(None))
    if flt.stream is not None:
        cond = and_(cond, outbox.c.stream == flt.stream)
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
_OUTSTANDING_NAMES = (
    "message_id",
    "batch_id",
    "lease_owner",
    "exchange",
    "routing_key",
    "stream",
)


def _lanes_of_stream() -> ScalarSelect[int]:
    """A stream row's lane count (one per stream, fixed: ``ensure_lanes``); NULL for others."""
    return (
        select(stream_lanes.c.lanes)
        .where(stream_lanes.c.stream == outbox.c.stream)
        .limit(1)
        .scalar_subquery()
    )


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
    plain = [
        c
        for c in outbox.c
        if c.name not in _OUTSTANDING_NAMES
        and c.name != "body"
        and c.name not in SETTLEMENT_COLUMNS
    ]
    stmt = (
        select(
            *plain, *(c for pair in shown for c in pair), sent, _lanes_of_stream().label("lanes")
        )
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
        lane=row["id"] % row["lanes"] if row["stream"] is not None and row["lanes"] else None,
    )


@dataclass(frozen=True, slots=True)
class StreamLane:
    """One lane of a stream: one producer reference on the broker, held by one publisher at a
    time (``owner`` until ``lease_until``), giving publishing ids from ``next_seq`` on."""

    stream: str
    lane: int
    lanes: int
    reference: str
    next_seq: int
    owner: str | None
    lease_until: dt.datetime | None
    taken_at: dt.datetime | None
    takeovers: int
    #: the lane's rows in flight now (publishing ids given, confirm not yet written)
    in_flight: int
    #: held, and its lease not run out (an expired lease is taken by the next publisher to look)
    held: bool


def list_lanes(engine: Engine, *, now: dt.datetime, stream: str | None = None) -> list[StreamLane]:
    """Every lane (of one ``stream``, if given) by stream and lane, with its rows in flight
    (counted from ``ix_outbox_stream_open``: open stream rows only)."""
    flying = (
        select(outbox.c.stream, (outbox.c.id % stream_lanes.c.lanes).label("lane"))
        .join(
            stream_lanes, and_(stream_lanes.c.stream == outbox.c.stream, stream_lanes.c.lane == 0)
        )
        .where(outbox.c.stream.is_not(None), outbox.c.status == Status.IN_FLIGHT)
    )
    lanes = select(stream_lanes).order_by(stream_lanes.c.stream, stream_lanes.c.lane)
    if stream is not None:
        flying = flying.where(outbox.c.stream == stream)
        lanes = lanes.where(stream_lanes.c.stream == stream)
    counted = flying.subquery()
    per_lane = select(counted.c.stream, counted.c.lane, func.count()).group_by(
        counted.c.stream, counted.c.lane
    )
    with engine.connect() as conn:
        rows = conn.execute(lanes).mappings().all()
        counts = {(s, int(n)): int(c) for s, n, c in conn.execute(per_lane).all()}
    return [
        from_row(
            StreamLane,
            row,
            in_flight=counts.get((row["stream"], row["lane"]), 0),
            held=row["owner"] is not None
            and row["lease_until"] is not None
            and row["lease_until"] > now,
        )
        for row in rows
    ]
