"""Terminal failures grouped by cause: by status, exchange (or stream), routing key and reason
for ``GET /v1/failures`` and ``outbox failures``; a page of causes with their routing keys and
the totals for the console's failures page. A stream's rows (exchange and routing key empty)
are grouped by their stream, never with another stream's or the default exchange's.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, and_, func, or_, select

from app.outbox.read.scopes import cause_of
from app.outbox.read.sql import snapshot
from app.outbox.schema import outbox
from app.outbox.states import TERMINAL_FAILURES, Status


@dataclass(frozen=True, slots=True)
class FailureGroup:
    """Terminal failures sharing a cause: status, exchange, routing key and reason (a
    stream's: status, stream and reason)."""

    status: Status
    exchange: str
    routing_key: str
    reason: str
    rows: int
    first_created: dt.datetime | None
    last_created: dt.datetime | None
    sample_message_id: str
    stream: str | None = None


def failures_by_cause(engine: Engine, *, limit: int = 50) -> list[FailureGroup]:
    """Returned, nacked and failed rows grouped by cause, largest group first (served by the
    status index: terminal failures are few next to confirmed rows)."""
    reason = func.coalesce(outbox.c.last_error, outbox.c.reply_text, "")
    stmt = (
        select(
            outbox.c.status,
            outbox.c.exchange,
            outbox.c.routing_key,
            outbox.c.stream,
            reason.label("reason"),
            func.count().label("n"),
            func.min(outbox.c.created_at).label("first"),
            func.max(outbox.c.created_at).label("last"),
            func.min(outbox.c.message_id).label("sample"),
        )
        .where(outbox.c.status.in_([s.value for s in TERMINAL_FAILURES]))
        .group_by(outbox.c.status, outbox.c.exchange, outbox.c.routing_key, outbox.c.stream, reason)
        .order_by(func.count().desc(), outbox.c.exchange, outbox.c.stream)
        .limit(limit)
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return [
        FailureGroup(
            status=Status(r.status),
            exchange=r.exchange,
            routing_key=r.routing_key,
            reason=r.reason[:500],
            rows=int(r.n),
            first_created=r.first,
            last_created=r.last,
            sample_message_id=r.sample,
            stream=r.stream,
        )
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class KeyCount:
    """The rows of one routing key within a cause."""

    routing_key: str
    rows: int
    sample_message_id: str


@dataclass(frozen=True, slots=True)
class CauseGroup:
    """Terminal failures with one cause: status, exchange or stream, and reason
    (:func:`cause_of`), with the breakdown by routing key (the largest ``keys`` first; the rest
    summed in ``more_*``)."""

    status: Status
    exchange: str
    stream: str | None
    cause: str
    rows: int
    first_created: dt.datetime | None
    last_created: dt.datetime | None
    sample_message_id: str
    keys: list[KeyCount]
    more_keys: int
    more_rows: int


@dataclass(frozen=True, slots=True)
class FailuresPage:
    """One page of causes, and the totals of every cause (what the database holds)."""

    groups: list[CauseGroup]
    total_rows: int
    total_groups: int
    offset: int


def _cause_key() -> list[ColumnElement[Any]]:
    return [outbox.c.status, outbox.c.exchange, outbox.c.stream, cause_of()]


def failures_page(
    engine: Engine, *, limit: int = 50, offset: int = 0, keys_per_group: int = 20
) -> FailuresPage:
    """Terminal failures by cause, largest first, one page of causes at a time, with the
    totals over every cause (read in one snapshot on PostgreSQL: the page's figures and its
    totals are the same moment's)."""
    terminal = outbox.c.status.in_(sorted(s.value for s in TERMINAL_FAILURES))
    cause = cause_of().label("cause")
    grouped = (
        select(outbox.c.status, outbox.c.exchange, outbox.c.stream, cause)
        .where(terminal)
        .group_by(*_cause_key())
    )
    counted = grouped.add_columns(func.count().label("n")).subquery()
    totals = select(func.count(), func.coalesce(func.sum(counted.c.n), 0)).select_from(counted)
    page = (
        grouped.add_columns(
            func.count().label("n"),
            func.min(outbox.c.created_at).label("first"),
            func.max(outbox.c.created_at).label("last"),
            func.min(outbox.c.message_id).label("sample"),
        )
        .order_by(
            func.count().desc(), outbox.c.status, outbox.c.exchange, outbox.c.stream, cause_of()
        )
        .limit(limit)
        .offset(offset)
    )
    with snapshot(engine) as conn:
        n_groups, n_rows = conn.execute(totals).one()
        rows = conn.execute(page).all()
        keys = _keys_of(conn, [_key(r) for r in rows]) if rows else {}
    groups = []
    for r in rows:
        every = keys.get(_key(r), [])
        shown, rest = every[:keys_per_group], every[keys_per_group:]
        groups.append(
            CauseGroup(
                status=Status(r.status),
                exchange=r.exchange,
                stream=r.stream,
                cause=r.cause,
                rows=int(r.n),
                first_created=r.first,
                last_created=r.last,
                sample_message_id=r.sample,
                keys=shown,
                more_keys=len(rest),
                more_rows=sum(k.rows for k in rest),
            )
        )
    return FailuresPage(
        groups=groups, total_rows=int(n_rows), total_groups=int(n_groups), offset=offset
    )


Cause = tuple[str, str, str | None, str]


def _key(row: Any) -> Cause:
    return (row.status, row.exchange, row.stream, row.cause)


def _keys_of(conn: Connection, causes: Sequence[Cause]) -> dict[Cause, list[KeyCount]]:
    """The routing keys of these causes, largest first."""
    cause = cause_of()
    which = or_(
        *[
            and_(
                outbox.c.status == st,
                outbox.c.exchange == ex,
                outbox.c.stream.is_not_distinct_from(sm),
                cause == c,
            )
            for st, ex, sm, c in causes
        ]
    )
    stmt = (
        select(
            outbox.c.status,
            outbox.c.exchange,
            outbox.c.stream,
            cause.label("cause"),
            outbox.c.routing_key,
            func.count().label("n"),
            func.min(outbox.c.message_id).label("sample"),
        )
        .where(which)
        .group_by(*_cause_key(), outbox.c.routing_key)
        .order_by(func.count().desc(), outbox.c.routing_key)
    )
    out: dict[Cause, list[KeyCount]] = {}
    for r in conn.execute(stmt):
        out.setdefault(_key(r), []).append(
            KeyCount(routing_key=r.routing_key, rows=int(r.n), sample_message_id=r.sample)
        )
    return out
