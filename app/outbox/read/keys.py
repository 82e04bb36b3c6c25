"""Ordering keys parked behind a terminal failure, with what waits behind each
(``GET /v1/keys/parked``, ``outbox parked``, the console's overview and parked page).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import Engine, func, select

from app.outbox.schema import outbox
from app.outbox.shown import marked, text_of
from app.outbox.states import TERMINAL_FAILURES, Status


@dataclass(frozen=True, slots=True)
class ParkedKey:
    """An ordering key whose head is a terminal failure: its later rows wait behind it."""

    ordering_key: str
    blocking_message_id: str
    blocking_status: Status
    blocking_error: str | None
    blocking_reply_code: int | None
    parked_since: dt.datetime | None  # the blocking row's last broker answer, publish or claim
    waiting: int  # later rows of the key, not yet published


def parked_keys(engine: Engine, *, limit: int = 100, after: str | None = None) -> list[ParkedKey]:
    """Parked keys in key order (keyset pages: ``after`` the last key of the previous page).

    Starts from the terminal failures (few, by nature) and keeps those that are their key's
    head (no earlier row of the key still open), then counts what waits behind each.
    """
    o, e = outbox.alias("o"), outbox.alias("e")
    failures = [s.value for s in TERMINAL_FAILURES]
    earlier_open = (
        select(e.c.id)
        .where(
            e.c.ordering_key == o.c.ordering_key,
            e.c.id < o.c.id,
            e.c.status.notin_([Status.CONFIRMED.value, Status.SKIPPED.value]),
        )
        .exists()
    )
    waiting = (
        select(func.count())
        .select_from(e)
        .where(
            e.c.ordering_key == o.c.ordering_key,
            e.c.id > o.c.id,
            e.c.status == Status.PENDING.value,
        )
        .scalar_subquery()
    )
    stmt = (
        select(
            o.c.ordering_key,
            *text_of(o.c.message_id, name="message_id"),
            o.c.status,
            *text_of(o.c.last_error, name="last_error"),
            o.c.reply_code,
            func.coalesce(o.c.confirmed_at, o.c.published_at, o.c.claimed_at).label("since"),
            waiting.label("waiting"),
        )
        .where(o.c.ordering_key.is_not(None), o.c.status.in_(failures), ~earlier_open)
        .order_by(o.c.ordering_key)
        .limit(limit)
    )
    if after is not None:
        stmt = stmt.where(o.c.ordering_key > after)
    with engine.connect() as conn:
        rows = [marked(r) for r in conn.execute(stmt).mappings().all()]
    return [
        ParkedKey(
            ordering_key=r["ordering_key"],
            blocking_message_id=r["message_id"],
            blocking_status=Status(r["status"]),
            blocking_error=r["last_error"],
            blocking_reply_code=r["reply_code"],
            parked_since=r["since"],
            waiting=int(r["waiting"]),
        )
        for r in rows
    ]
