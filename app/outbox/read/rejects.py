"""Rows the Spark writer refused in reject mode (``outbox_rejects``): a page of them, their
count, and their reasons grouped by shape (``GET /v1/rejects``, ``outbox rejects``, the
console's rejects page and overview).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, func, select

from app.outbox.read.sql import as_utc, from_row
from app.outbox.schema import rejects
from app.outbox.shown import marked, text_of


@dataclass(frozen=True, slots=True)
class WriterReject:
    """A row the Spark writer refused in reject mode: a bad value, or a message id the outbox
    holds for another message (a conflict), with the reason and the row as it came."""

    id: int
    batch_id: str
    sink: str
    message_id: str | None
    reason: str
    row_json: str
    created_at: dt.datetime


def writer_rejects(
    engine: Engine, *, batch_id: str | None = None, limit: int = 50, before: int | None = None
) -> list[WriterReject]:
    """``outbox_rejects``, newest first (keyset pages: ``before`` the last id of the previous
    page), all of them or one batch's (``ix_outbox_rejects_batch``)."""
    cols: list[Any] = []
    for c in rejects.c:
        cols += text_of(c) if c.name in ("message_id", "reason", "row_json", "sink") else [c]
    stmt = select(*cols).order_by(rejects.c.id.desc()).limit(limit)
    if batch_id is not None:
        stmt = stmt.where(rejects.c.batch_id == batch_id)
    if before is not None:
        stmt = stmt.where(rejects.c.id < before)
    with engine.connect() as conn:
        rows = [marked(r) for r in conn.execute(stmt).mappings().all()]
    return [from_row(WriterReject, r) for r in rows]


#: Most distinct reasons read to group the writer's rejects (their shapes are far fewer).
MAX_REJECT_REASONS = 10_000


@dataclass(frozen=True, slots=True)
class RejectReason:
    """Rejects whose reasons differ only in their numbers ("body is 2048 bytes, over the
    1024-byte maximum"): ``shape`` with each number as ``N``, the most frequent ``example``."""

    shape: str
    rows: int
    example: str
    last_at: dt.datetime


@dataclass(frozen=True, slots=True)
class RejectSummary:
    """The writer's rejects by reason; ``complete``: every distinct reason was read (else the
    figures cover the :data:`MAX_REJECT_REASONS` most frequent)."""

    rows: int
    batches: int
    reasons: list[RejectReason]
    complete: bool


def reason_shape(reason: str) -> str:
    """A reason with each run of digits as ``N``: rows refused for one cause group together."""
    return re.sub(r"[0-9]+", "N", reason)


def reject_summary(
    engine: Engine, *, batch_id: str | None = None, max_reasons: int = MAX_REJECT_REASONS
) -> RejectSummary:
    """The rows the Spark writer refused (``outbox_rejects``, all or one batch's through
    ``ix_outbox_rejects_batch``), grouped by reason shape, most rows first."""
    where = [rejects.c.batch_id == batch_id] if batch_id is not None else []
    by_reason = (
        select(rejects.c.reason, func.count().label("n"), func.max(rejects.c.created_at))
        .where(*where)
        .group_by(rejects.c.reason)
        .order_by(func.count().desc(), rejects.c.reason)
        .limit(max_reasons + 1)
    )
    batch_count = select(func.count(func.distinct(rejects.c.batch_id))).where(*where)
    with engine.connect() as conn:
        rows = conn.execute(by_reason).all()
        batches_seen = int(conn.execute(batch_count).scalar_one())
    complete = len(rows) <= max_reasons
    shapes: dict[str, list[Any]] = {}
    for reason, count, last in rows[:max_reasons]:
        shapes.setdefault(reason_shape(reason), []).append((reason, int(count), as_utc(last)))
    reasons = [
        RejectReason(
            shape=shape,
            rows=sum(c for _, c, _ in found),
            example=found[0][0],  # the most frequent: rows come most frequent first
            last_at=max(t for _, _, t in found),
        )
        for shape, found in shapes.items()
    ]
    reasons.sort(key=lambda r: (-r.rows, r.shape))
    return RejectSummary(
        rows=sum(r.rows for r in reasons),
        batches=batches_seen,
        reasons=reasons,
        complete=complete,
    )


def reject_count(engine: Engine, *, cap: int = 10_000) -> tuple[int, bool]:
    """How many rows the writer refused, counted up to ``cap`` (and whether there are more)."""
    capped = select(rejects.c.id).limit(cap + 1).subquery()
    with engine.connect() as conn:
        count = int(conn.execute(select(func.count()).select_from(capped)).scalar_one())
    return min(count, cap), count > cap
