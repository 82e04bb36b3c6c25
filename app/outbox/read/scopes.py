"""The SQL of a :class:`~app.outbox.scope.Scope`: one definition of which rows a search, a count,
a failures page and a republish (:mod:`app.outbox.actions`) mean, with the time bound a
search an index cannot narrow gets.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from sqlalchemy import ColumnElement, Engine, and_, func, literal_column, or_, select, true

from app.outbox.schema import outbox
from app.outbox.scope import CAUSE_LENGTH, Scope
from app.outbox.states import Status


def reason_of() -> ColumnElement[str]:
    """A row's reason: its error, else the broker's reply text."""
    return func.coalesce(outbox.c.last_error, outbox.c.reply_text, literal_column("''"))


def cause_of() -> ColumnElement[str]:
    """A failure's cause: the first :data:`CAUSE_LENGTH` characters of its reason (constants
    inlined, not bound: PostgreSQL must see the grouped and the selected expression as one)."""
    return func.substr(reason_of(), literal_column("1"), literal_column(str(CAUSE_LENGTH)))


def scope_conditions(flt: Scope) -> list[ColumnElement[bool]]:
    """The SQL conditions of a scope: one definition for searches and republishes."""
    conds: list[ColumnElement[bool]] = []
    if flt.statuses:
        conds.append(outbox.c.status.in_(sorted(st.value for st in flt.statuses)))
    for column, value in (
        (outbox.c.message_id, flt.message_id),
        (outbox.c.batch_id, flt.batch_id),
        (outbox.c.exchange, flt.exchange),
        (outbox.c.routing_key, flt.routing_key),
        (outbox.c.stream, flt.stream),
        (outbox.c.ordering_key, flt.ordering_key),
    ):
        if value is not None:
            conds.append(column == value)
    if flt.stream is None and (flt.exchange is not None or flt.routing_key is not None):
        # a stream's rows have an empty exchange and routing key too: the default exchange's
        # rows (exchange "") are never a stream's
        conds.append(outbox.c.stream.is_(None))
    if flt.reason:
        needle = flt.reason.lower()
        conds.append(
            or_(
                func.lower(func.coalesce(outbox.c.last_error, "")).contains(
                    needle, autoescape=True
                ),
                func.lower(func.coalesce(outbox.c.reply_text, "")).contains(
                    needle, autoescape=True
                ),
            )
        )
    if flt.cause is not None:
        conds.append(cause_of() == flt.cause)
    if flt.created_after is not None:
        conds.append(outbox.c.created_at >= flt.created_after)
    if flt.created_before is not None:
        conds.append(outbox.c.created_at < flt.created_before)
    return conds


#: The statuses whose rows a partial index holds (all but ``confirmed``, the bulk of the table).
INDEXED_STATUSES = frozenset(Status) - {Status.CONFIRMED}
#: A search an index cannot narrow (a reason, a routing key, confirmed rows) reads the rows
#: written in this window unless it names a time range (``ix_outbox_created``).
SEARCH_WINDOW = dt.timedelta(hours=24)


def anchored(flt: Scope) -> bool:
    """Whether an index narrows ``flt`` without a time range: a message, a batch, or statuses
    a partial index holds."""
    return bool(
        flt.message_id is not None
        or flt.batch_id is not None
        or (flt.statuses and flt.statuses <= INDEXED_STATUSES)
    )


def search_window(flt: Scope, *, now: dt.datetime) -> Scope | None:
    """``flt`` bounded to the rows written in the last :data:`SEARCH_WINDOW` when no index
    narrows it and it names no time range (None: it needs no bound)."""
    if anchored(flt) or flt.created_after is not None or flt.created_before is not None:
        return None
    return dataclasses.replace(flt, created_after=now - SEARCH_WINDOW)


def count_scope(engine: Engine, *, flt: Scope, cap: int = 10_000) -> tuple[int, bool]:
    """How many rows match ``flt``, counted up to ``cap`` (True: there are more)."""
    conds = scope_conditions(flt)
    capped = select(outbox.c.id).where(and_(*conds) if conds else true()).limit(cap + 1)
    with engine.connect() as conn:
        n = int(conn.execute(select(func.count()).select_from(capped.subquery())).scalar_one())
    return min(n, cap), n > cap
