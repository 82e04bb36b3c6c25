"""Read-side queries for operators: stats, outstanding confirms, batches, one message, metrics.

Nothing here changes a row (state changes live in the store, the registry, the operators' actions
and retention: see :mod:`app.outbox.database`). Every function takes the engine and the current
time as keyword arguments and returns plain frozen dataclasses, so the REST API and the CLI share
them. Each works on PostgreSQL and on SQLite; percentiles are computed in Python from a bounded
select for that reason.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Text,
    and_,
    case,
    cast,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    true,
    tuple_,
    union_all,
)

from app.outbox.content import ContentError, load_document
from app.outbox.database import written
from app.outbox.reports import PublisherReport, read_report
from app.outbox.schema import (
    UTCDateTime,
    audit,
    batches,
    events,
    held,
    outbox,
    publishers,
    rejects,
    samples,
)
from app.outbox.scope import CAUSE_LENGTH, Scope
from app.outbox.shown import (
    MAX_SHOWN_DOCUMENT,
    MAX_SHOWN_TEXT,
    body_of,
    capped_length,
    document_of,
    marked,
    text_of,
)
from app.outbox.states import TERMINAL_FAILURES, Status
from app.outbox.upkeep import Upkeep

MAX_ROW_ID = 2**63 - 1
T = TypeVar("T")


class BadCursor(ValueError):
    """A pagination cursor that this module did not produce (or that was tampered with)."""


# ------------------------------------------------------------------------ small pure helpers


def age_seconds(since: dt.datetime | None, now: dt.datetime) -> float | None:
    """Seconds from ``since`` to ``now``, never negative (clocks of other hosts may run ahead)."""
    if since is None:
        return None
    return max(0.0, (now - since).total_seconds())


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of an ascending sequence; None when empty."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def plain_text(value: str, *, max_length: int = 1024) -> bool:
    """Whether ``value`` can be stored and compared by both backends: bounded, no NUL byte,
    valid UTF-8 (no lone surrogates)."""
    if len(value) > max_length or "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def encode_cursor(payload: dict[str, Any]) -> str:
    raw = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> dict[str, Any]:
    """The payload of a cursor made by :func:`encode_cursor`; :class:`BadCursor` otherwise."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        payload = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError) as exc:  # RecursionError: deep nesting
        raise BadCursor("not a cursor returned by this endpoint") from exc
    if not isinstance(payload, dict):
        raise BadCursor("not a cursor returned by this endpoint")
    return payload


# ------------------------------------------------------------------------------ stats


@dataclass(frozen=True, slots=True)
class PublisherInfo:
    publisher_id: str
    hostname: str
    pid: int
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    stopped_at: dt.datetime | None
    alive: bool
    stats: dict[str, Any] | None

    @property
    def report(self) -> PublisherReport | None:
        """The publisher's own figures at its last heartbeat (one model on both sides)."""
        return read_report(self.stats)

    @property
    def blocked(self) -> bool:
        """The broker blocks this live publisher (a resource alarm)."""
        report = self.report
        return self.alive and report is not None and report.blocked


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Confirm latency (``confirmed_at - published_at``) of recently confirmed rows, seconds."""

    window_seconds: float
    samples: int
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True, slots=True)
class OutboxStats:
    at: dt.datetime
    counts: dict[Status, int]
    oldest_pending_age_seconds: float | None
    oldest_in_flight_age_seconds: float | None
    confirm_latency: LatencySummary
    possible_duplicates: int
    operator_republished: int
    publishers: list[PublisherInfo]
    #: ``counts[CONFIRMED]`` is PostgreSQL's estimate (a large outbox), not a count
    confirmed_estimated: bool = False
    #: pending rows of Spark batches in fail mode not recorded yet (parked by ``format("outbox")``
    #: or in a held batch of ``OutboxSink``/``write_outbox``); released when the batch is
    #: recorded, removed when it fails; left by a driver that died in between
    parked: int = 0
    oldest_parked_age_seconds: float | None = None
    #: pending rows whose delivery time (``not_before``) is still ahead: not late, not counted
    #: in the oldest pending age; and the earliest of those times
    delayed: int = 0
    next_delayed_at: dt.datetime | None = None
    #: the outbox table's size, dead rows and autovacuum (PostgreSQL; None on SQLite)
    upkeep: Upkeep | None = None

    @property
    def publishers_alive(self) -> int:
        return sum(1 for p in self.publishers if p.alive)

    @property
    def blocked_publishers(self) -> list[str]:
        """Live publishers the broker blocks now."""
        return [p.publisher_id for p in self.publishers if p.blocked]


#: Set aside: terminal failures and skipped rows (the partial index ``ix_outbox_aside``).
ASIDE = (Status.RETURNED, Status.NACKED, Status.FAILED, Status.SKIPPED)
#: On PostgreSQL, above this many rows (its own estimate) the ``confirmed`` count is estimated
#: from the planner's statistics instead of counted: every other count stays exact and reads
#: only its own small partial index.
EXACT_CONFIRMED_UP_TO = 200_000


def status_counts(conn: Connection) -> tuple[dict[Status, int], int, bool]:
    """Rows per status (every status present, zero when none), the sum of ``lost_confirms``
    (possible duplicates), and whether ``confirmed`` is an estimate. Each count reads a partial
    index (pending: ``ix_outbox_due``, in flight: ``ix_outbox_lease``, set aside:
    ``ix_outbox_aside``, lost confirms: ``ix_outbox_lost``); only ``confirmed`` would read the
    whole table, so on a large PostgreSQL outbox it is the table's estimated size minus the
    rest (labelled as such)."""
    counts = dict.fromkeys(Status, 0)
    for status in (Status.PENDING, Status.IN_FLIGHT):
        stmt = (
            select(func.count()).select_from(outbox).where(outbox.c.status == written(status.value))
        )
        counts[status] = int(conn.execute(stmt).scalar_one())
    aside = (
        select(outbox.c.status, func.count())
        .where(outbox.c.status.in_([written(s.value) for s in ASIDE]))
        .group_by(outbox.c.status)
    )
    for status, count in conn.execute(aside).all():
        counts[Status(status)] = int(count)
    lost_sum = select(func.coalesce(func.sum(outbox.c.lost_confirms), 0)).where(
        outbox.c.lost_confirms > written(0)  # ix_outbox_lost's predicate
    )
    lost = int(conn.execute(lost_sum).scalar_one())
    estimate = _estimated_rows(conn)
    if estimate is not None and estimate > EXACT_CONFIRMED_UP_TO:
        counts[Status.CONFIRMED] = max(0, estimate - sum(counts.values()))
        return counts, lost, True
    confirmed = (
        select(func.count()).select_from(outbox).where(outbox.c.status == Status.CONFIRMED.value)
    )
    counts[Status.CONFIRMED] = int(conn.execute(confirmed).scalar_one())
    return counts, lost, False


_UPKEEP = text(
    """
    SELECT s.n_live_tup, s.n_dead_tup, pg_table_size(c.oid), pg_indexes_size(c.oid),
           greatest(s.last_vacuum, s.last_autovacuum), greatest(s.last_analyze, s.last_autoanalyze),
           s.autovacuum_count,
           EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.relid = c.oid),
           current_setting('autovacuum') = 'on',
           (SELECT setting::float FROM pg_settings WHERE name = 'autovacuum_naptime'),
           coalesce(c.reloptions, '{}')
    FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid
    WHERE c.oid = to_regclass(:t)
    """
)


def table_upkeep(conn: Connection) -> Upkeep | None:
    """The outbox table's upkeep figures (PostgreSQL's statistics and settings, one
    statement, no scan of the table); None elsewhere."""
    if conn.dialect.name != "postgresql":
        return None
    row = conn.execute(_UPKEEP, {"t": outbox.name}).one_or_none()
    if row is None:
        return None
    options = dict(o.split("=", 1) for o in row[10])
    return Upkeep(
        live_rows=int(row[0]),
        dead_rows=int(row[1]),
        table_bytes=int(row[2]),
        index_bytes=int(row[3]),
        last_vacuum_at=row[4],
        last_analyze_at=row[5],
        autovacuum_runs=int(row[6]),
        vacuum_running=bool(row[7]),
        server_autovacuum=bool(row[8]),
        naptime_seconds=float(row[9]),
        table_settings={k: v for k, v in options.items() if k.startswith("autovacuum")},
    )


def _estimated_rows(conn: Connection) -> int | None:
    """PostgreSQL's estimate of the outbox's rows (``pg_class.reltuples``, kept by ANALYZE and
    autovacuum); None elsewhere or before the table was ever analysed."""
    if conn.dialect.name != "postgresql":
        return None
    stmt = text("SELECT reltuples FROM pg_class WHERE oid = to_regclass(:t)")
    value = conn.execute(stmt, {"t": outbox.name}).scalar()
    return None if value is None or value < 0 else int(value)


def _sent_at() -> ColumnElement[dt.datetime]:
    """When the publish of the current attempt went out: only rows with a delivery tag have one
    (a claim clears the tag but keeps the previous attempt's ``published_at``)."""
    return case((outbox.c.delivery_tag.is_not(None), outbox.c.published_at), else_=None)


def _held_since() -> ColumnElement[dt.datetime]:
    """Since when an in-flight row waits: its publish, or its claim while not yet sent (the
    broker blocks the publisher, say): a row claimed and stuck must age too."""
    return func.coalesce(_sent_at(), outbox.c.claimed_at)


#: The Spark data source parks rows at ``available_at`` 9999-12-31 (``spark_writer.envelope``):
#: no real retry is scheduled this late.
PARKED_FROM = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)


def parked_rows(conn: Connection, *, now: dt.datetime) -> tuple[int, float | None]:
    """(pending rows of Spark batches not recorded yet, the oldest one's age in seconds): rows
    the data source parked (the top of ``ix_outbox_due``) and rows of held batches (fail mode
    of ``OutboxSink`` and ``write_outbox``: ``outbox_held``, then ``ix_outbox_batch``)."""
    pending = outbox.c.status == Status.PENDING
    parked = pending & (outbox.c.available_at >= PARKED_FROM)
    on_hold = (
        pending
        & (outbox.c.available_at < PARKED_FROM)
        & outbox.c.batch_id.in_(select(held.c.batch_id))
    )
    count, oldest = 0, None
    for cond in (parked, on_hold):
        n, first = conn.execute(
            select(func.count(), func.min(outbox.c.created_at)).where(cond)
        ).one()
        count += int(n)
        if first is not None and (oldest is None or first < oldest):
            oldest = first
    return count, age_seconds(oldest, now)


def delayed_rows(conn: Connection, *, now: dt.datetime) -> tuple[int, dt.datetime | None]:
    """(pending rows whose ``not_before`` is still ahead, the earliest such time): delayed
    delivery, not late. Reads only ``ix_outbox_delayed``."""
    count, first = conn.execute(
        select(func.count(), func.min(outbox.c.not_before)).where(
            outbox.c.status == Status.PENDING,
            outbox.c.not_before.is_not(None),
            outbox.c.not_before > now,
        )
    ).one()
    return int(count), first


def _due_since() -> ColumnElement[dt.datetime]:
    """Since when a pending row could have been published: its creation, or its ``not_before``
    when that came later (a delayed row is late only from its delivery time on)."""
    return case(
        (outbox.c.not_before > outbox.c.created_at, outbox.c.not_before),
        else_=outbox.c.created_at,
    )


def oldest_ages(conn: Connection, *, now: dt.datetime) -> tuple[float | None, float | None]:
    """(age of the oldest pending row since it was due (created, or its ``not_before`` when
    later), age of the oldest in-flight row since it was sent, or claimed when not sent yet), in
    seconds. Parked rows and rows of held batches are not waiting for a publisher: they have
    their own figure (:func:`parked_rows`); nor are delayed rows (:func:`delayed_rows`)."""
    pending = select(func.min(_due_since())).where(
        outbox.c.status == Status.PENDING,
        outbox.c.available_at < PARKED_FROM,
        outbox.c.batch_id.not_in(select(held.c.batch_id)),  # see PublisherStore._due
        or_(outbox.c.not_before.is_(None), outbox.c.not_before <= now),
    )
    in_flight = select(func.min(_held_since())).where(outbox.c.status == Status.IN_FLIGHT)
    return (
        age_seconds(conn.execute(pending).scalar_one(), now),
        age_seconds(conn.execute(in_flight).scalar_one(), now),
    )


#: The latency walk reads at most this many times ``max_rows`` of the newest ids: on an outbox
#: whose recent rows are not confirmed yet it stops there instead of walking the whole table.
LATENCY_WALK = 10


def confirm_latencies(
    conn: Connection, *, now: dt.datetime, window: dt.timedelta, max_rows: int
) -> list[float]:
    """Latencies of confirms within ``window`` among the newest rows (at most ``max_rows``,
    newest by id, among the ``LATENCY_WALK * max_rows`` newest ids: a bounded primary-key walk,
    no sort of the table), sorted."""
    newest = select(func.max(outbox.c.id)).scalar_subquery()
    stmt = (
        select(outbox.c.published_at, outbox.c.confirmed_at)
        .where(
            outbox.c.id > newest - LATENCY_WALK * max_rows,
            outbox.c.status == Status.CONFIRMED,
            outbox.c.confirmed_at >= now - window,
            outbox.c.published_at.is_not(None),
        )
        .order_by(outbox.c.id.desc())
        .limit(max_rows)
    )
    return sorted(
        max(0.0, (confirmed - published).total_seconds())
        for published, confirmed in conn.execute(stmt).all()
    )


def publisher_rows(
    conn: Connection, *, now: dt.datetime, alive_after: float, limit: int = 100
) -> list[PublisherInfo]:
    """Known publishers, most recent heartbeat first. Alive: not stopped, beat within
    ``alive_after`` seconds."""
    stmt = select(publishers).order_by(publishers.c.heartbeat_at.desc()).limit(limit)
    out = []
    for row in conn.execute(stmt).mappings():
        beat_age = age_seconds(row["heartbeat_at"], now) or 0.0
        stats = row["stats"] if isinstance(row["stats"], dict) else None
        out.append(
            PublisherInfo(
                publisher_id=row["publisher_id"],
                hostname=row["hostname"],
                pid=row["pid"],
                started_at=row["started_at"],
                heartbeat_at=row["heartbeat_at"],
                stopped_at=row["stopped_at"],
                stats=stats,
                alive=row["stopped_at"] is None and beat_age <= alive_after,
            )
        )
    return out


def operator_republished(conn: Connection) -> int:
    """Rows moved back to pending by operators, over the audit log."""
    stmt = select(func.coalesce(func.sum(audit.c.count), 0)).where(audit.c.action == "republish")
    return int(conn.execute(stmt).scalar_one())


def read_stats(
    engine: Engine,
    *,
    now: dt.datetime,
    alive_after: float,
    latency_window: dt.timedelta,
    latency_rows: int,
) -> OutboxStats:
    """Everything ``GET /v1/stats`` and ``outbox status`` show, read in one transaction."""
    with engine.connect() as conn:
        pending_age, in_flight_age = oldest_ages(conn, now=now)
        lat = confirm_latencies(conn, now=now, window=latency_window, max_rows=latency_rows)
        counts, lost, estimated = status_counts(conn)
        parked, parked_age = parked_rows(conn, now=now)
        delayed, next_delayed = delayed_rows(conn, now=now)
        upkeep = table_upkeep(conn)
        return OutboxStats(
            at=now,
            counts=counts,
            confirmed_estimated=estimated,
            parked=parked,
            oldest_parked_age_seconds=parked_age,
            delayed=delayed,
            next_delayed_at=next_delayed,
            oldest_pending_age_seconds=pending_age,
            oldest_in_flight_age_seconds=in_flight_age,
            confirm_latency=summarize_latency(lat, window=latency_window),
            possible_duplicates=lost,
            operator_republished=operator_republished(conn),
            publishers=publisher_rows(conn, now=now, alive_after=alive_after),
            upkeep=upkeep,
        )


def summarize_latency(ordered: Sequence[float], *, window: dt.timedelta) -> LatencySummary:
    return LatencySummary(
        window_seconds=window.total_seconds(),
        samples=len(ordered),
        p50=percentile(ordered, 0.5),
        p90=percentile(ordered, 0.9),
        p99=percentile(ordered, 0.99),
    )


# ---------------------------------------------------------------- outstanding confirms


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


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None


def _outstanding_where(
    flt: OutstandingFilter, *, now: dt.datetime, after: OutstandingKey | None
) -> ColumnElement[bool]:
    sent = _sent_at()
    cond: ColumnElement[bool] = outbox.c.status == Status.IN_FLIGHT
    if flt.publisher is not None:
        cond = and_(cond, outbox.c.lease_owner == flt.publisher)
    if flt.exchange is not None:
        cond = and_(cond, outbox.c.exchange == flt.exchange)
    if flt.batch_id is not None:
        cond = and_(cond, outbox.c.batch_id == flt.batch_id)
    if flt.min_age_seconds is not None:
        cond = and_(cond, _held_since() <= now - dt.timedelta(seconds=flt.min_age_seconds))
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
    sent = _sent_at().label("sent_at")
    shown = [*(text_of(outbox.c[n]) for n in _OUTSTANDING_NAMES)]
    plain = [c for c in outbox.c if c.name not in _OUTSTANDING_NAMES and c.name != "body"]
    stmt = (
        select(*plain, *(c for pair in shown for c in pair), sent)
        .where(_outstanding_where(flt, now=now, after=after))
        .order_by(case((_sent_at().is_(None), 0), else_=1), _sent_at(), outbox.c.id)
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
    return OutstandingConfirm(
        id=row["id"],
        message_id=row["message_id"],
        batch_id=row["batch_id"],
        publisher=row["lease_owner"],
        channel_id=row["channel_id"],
        delivery_tag=row["delivery_tag"],
        attempt=row["attempts"],
        max_attempts=row["max_attempts"],
        exchange=row["exchange"],
        routing_key=row["routing_key"],
        published_at=row["sent_at"],
        claimed_at=row["claimed_at"],
        age_seconds=age_seconds(row["sent_at"] or row["claimed_at"], now),
        lease_until=row["lease_until"],
        lost_confirms=row["lost_confirms"],
    )


# ---------------------------------------------------------------------------- batches


@dataclass(frozen=True, slots=True)
class BatchSummary:
    """One Spark batch (or any ``batch_id`` rows were written with)."""

    batch_id: str
    sink: str | None
    spark_batch_id: int | None
    query_id: str | None
    committed_at: dt.datetime | None
    row_count: int | None
    rejected_count: int | None
    rows: int
    counts: dict[Status, int]
    first_created_at: dt.datetime | None
    last_created_at: dt.datetime | None
    first_published_at: dt.datetime | None
    last_published_at: dt.datetime | None
    first_confirmed_at: dt.datetime | None
    last_confirmed_at: dt.datetime | None
    republished: int

    @property
    def written_at(self) -> dt.datetime | None:
        """The batch's latest write (its newest row, or its record): the list's order."""
        known = [t for t in (self.last_created_at, self.committed_at) if t is not None]
        return max(known) if known else None


def _batch_walk(*, status: Status | None) -> Any:
    """Every distinct ``batch_id`` of the outbox (with ``status``: holding a row in it), one
    index probe each (a recursive CTE, i.e. a loose index scan: it never reads a batch's rows
    one by one)."""
    inner = outbox.alias("o2")

    def probe(bound: Any) -> Any:
        cond: ColumnElement[bool] = true() if bound is None else inner.c.batch_id > bound
        if status is not None:
            cond = and_(cond, inner.c.status == status)
        return select(func.min(inner.c.batch_id)).where(cond).scalar_subquery()

    walk = select(probe(None).label("batch_id")).cte("walk", recursive=True)
    walk = walk.union_all(select(probe(walk.c.batch_id)).where(walk.c.batch_id.is_not(None)))
    return select(walk.c.batch_id).where(walk.c.batch_id.is_not(None))


@dataclass(frozen=True, slots=True)
class BatchKey:
    """Where a batch sits in the newest-first order: its latest write (the newest of its rows'
    ``created_at`` and its ``outbox_batches.committed_at``), ties by ``batch_id``."""

    written_at: dt.datetime
    batch_id: str


def _batch_keys(status: Status | None) -> Any:
    """``(batch_id, written_at)`` of every batch: a probe of ``ix_outbox_batch_written`` per
    distinct batch id for its newest row, and the recorded batches (with ``status``: only
    those holding a row in it)."""
    walked = _batch_walk(status=status).cte("walked")
    newest = (
        select(func.max(outbox.c.created_at))
        .where(outbox.c.batch_id == walked.c.batch_id)
        .scalar_subquery()
    )
    recorded = select(batches.c.batch_id, batches.c.committed_at.label("written_at"))
    if status is not None:
        recorded = recorded.where(batches.c.batch_id.in_(select(walked.c.batch_id)))
    both = union_all(select(walked.c.batch_id, newest.label("written_at")), recorded).subquery()
    return (
        select(both.c.batch_id, func.max(both.c.written_at).label("written_at"))
        .group_by(both.c.batch_id)
        .subquery()
    )


def _page_batch_keys(
    conn: Connection,
    *,
    before: BatchKey | None,
    after: BatchKey | None,
    status: Status | None,
    limit: int,
) -> list[BatchKey]:
    """Up to ``limit`` keys newest first: those older than ``before`` (or the newest), or with
    ``after``, the ones just newer than it (still returned newest first)."""
    keys = _batch_keys(status)
    key = tuple_(keys.c.written_at, keys.c.batch_id)
    stmt = select(keys.c.batch_id, keys.c.written_at)
    if after is not None:
        bound = tuple_(literal(after.written_at, UTCDateTime()), literal(after.batch_id))
        stmt = stmt.where(key > bound).order_by(keys.c.written_at, keys.c.batch_id)
    else:
        if before is not None:
            bound = tuple_(literal(before.written_at, UTCDateTime()), literal(before.batch_id))
            stmt = stmt.where(key < bound)
        stmt = stmt.order_by(keys.c.written_at.desc(), keys.c.batch_id.desc())
    found = [
        BatchKey(written_at=_as_utc(r.written_at), batch_id=str(r.batch_id))
        for r in conn.execute(stmt.limit(limit))
    ]
    return found[::-1] if after is not None else found


def _as_utc(value: Any) -> dt.datetime:
    """A timestamp out of an aggregate (SQLite hands back the stored text)."""
    stamp = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
    assert isinstance(stamp, dt.datetime)
    return stamp.replace(tzinfo=dt.UTC) if stamp.tzinfo is None else stamp.astimezone(dt.UTC)


def _when_status(status: Status | None, col: Any) -> Any:
    return col if status is None else case((outbox.c.status == status, col), else_=None)


def _summaries(
    conn: Connection, batch_ids: Sequence[str], *, timings: bool = True
) -> list[BatchSummary]:
    """The batches' summaries. ``timings=False``: without the first/last published and
    confirmed times, from indexes only (:func:`_tallies`), so a page of large batches never
    reads their rows."""
    if not batch_ids:
        return []
    aggs = _aggregates(conn, batch_ids) if timings else _tallies(conn, batch_ids)
    meta_stmt = select(batches).where(batches.c.batch_id.in_(list(batch_ids)))
    metas = {row["batch_id"]: row for row in conn.execute(meta_stmt).mappings()}
    return [_summary(b, aggs.get(b), metas.get(b)) for b in batch_ids if b in aggs or b in metas]


def _aggregates(conn: Connection, batch_ids: Sequence[str]) -> dict[str, Any]:
    """Per batch, every figure of its summary, read from its rows."""
    per_status = [func.sum(case((outbox.c.status == s, 1), else_=0)).label(s.value) for s in Status]
    confirmed_at = _when_status(Status.CONFIRMED, outbox.c.confirmed_at)
    agg = (
        select(
            outbox.c.batch_id,
            func.count().label("rows"),
            *per_status,
            func.min(outbox.c.created_at).label("first_created_at"),
            func.max(outbox.c.created_at).label("last_created_at"),
            func.min(outbox.c.published_at).label("first_published_at"),
            func.max(outbox.c.published_at).label("last_published_at"),
            func.min(confirmed_at).label("first_confirmed_at"),
            func.max(confirmed_at).label("last_confirmed_at"),
            func.sum(outbox.c.lost_confirms).label("republished"),
        )
        .where(outbox.c.batch_id.in_(list(batch_ids)))
        .group_by(outbox.c.batch_id)
    )
    return {row["batch_id"]: row for row in conn.execute(agg).mappings()}


def _tallies(conn: Connection, batch_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per batch: its rows, first and last write, rows per status and lost confirms, read from
    indexes only (``conn`` must see one snapshot: :func:`_snapshot`).

    The rows and the write times come from ``ix_outbox_batch_written`` (never updated: an
    index-only scan once vacuum has marked the pages); the rows not confirmed from the partial
    indexes of pending (``ix_outbox_due``), in-flight (``ix_outbox_lease``) and set-aside rows
    (``ix_outbox_aside``), the lost confirms from ``ix_outbox_lost``. ``confirmed`` is the rest:
    every other status has an index of its own, so the subtraction is exact. The cost is the
    page's index entries plus the outbox's unsettled rows, never the batches' confirmed rows
    (which the summary with timings reads: half the table for 50 batches of 10,000 rows in a
    1,000,000-row outbox)."""
    ids = list(batch_ids)
    mine = outbox.c.batch_id.in_(ids)
    totals = (
        select(
            outbox.c.batch_id,
            func.count().label("rows"),
            func.min(outbox.c.created_at).label("first_created_at"),
            func.max(outbox.c.created_at).label("last_created_at"),
        )
        .where(mine)
        .group_by(outbox.c.batch_id)
    )
    out: dict[str, dict[str, Any]] = {}
    for row in conn.execute(totals).mappings():
        out[row["batch_id"]] = {**row, **dict.fromkeys(s.value for s in Status), "republished": 0}
    if not out:
        return out
    unsettled = [
        select(outbox.c.batch_id, outbox.c.status, func.count().label("n"))
        .where(mine, outbox.c.status == status.value)
        .group_by(outbox.c.batch_id, outbox.c.status)
        for status in (Status.PENDING, Status.IN_FLIGHT)
    ]
    aside = (
        select(outbox.c.batch_id, outbox.c.status, func.count().label("n"))
        .where(mine, outbox.c.status.in_([s.value for s in ASIDE]))
        .group_by(outbox.c.batch_id, outbox.c.status)
    )
    for batch_id, status, n in conn.execute(union_all(*unsettled, aside)).all():
        out[batch_id][status] = int(n)
    lost = (
        select(outbox.c.batch_id, func.sum(outbox.c.lost_confirms))
        .where(mine, outbox.c.lost_confirms > 0)
        .group_by(outbox.c.batch_id)
    )
    for batch_id, n in conn.execute(lost).all():
        out[batch_id]["republished"] = int(n)
    for tally in out.values():
        others = sum(tally[s.value] or 0 for s in Status if s is not Status.CONFIRMED)
        tally[Status.CONFIRMED.value] = int(tally["rows"]) - others
    return out


def _summary(batch_id: str, agg: Any, meta: Any) -> BatchSummary:
    def a(key: str) -> Any:
        return agg.get(key) if agg is not None else None

    def m(key: str) -> Any:
        return meta[key] if meta is not None else None

    return BatchSummary(
        batch_id=batch_id,
        sink=m("sink"),
        spark_batch_id=m("spark_batch_id"),
        query_id=m("query_id"),
        committed_at=m("committed_at"),
        row_count=m("row_count"),
        rejected_count=m("rejected_count"),
        rows=int(a("rows") or 0),
        counts={s: int(a(s.value) or 0) for s in Status},
        first_created_at=a("first_created_at"),
        last_created_at=a("last_created_at"),
        first_published_at=a("first_published_at"),
        last_published_at=a("last_published_at"),
        first_confirmed_at=a("first_confirmed_at"),
        last_confirmed_at=a("last_confirmed_at"),
        republished=int(a("republished") or 0),
    )


@dataclass(frozen=True, slots=True)
class BatchCursor:
    """A page link of the batches list: the key it starts from and which way it goes
    (``older``: the batches after it in newest-first order; ``newer``: the ones before)."""

    key: BatchKey
    newer: bool

    def encode(self) -> str:
        return encode_cursor(
            {
                "k": "batches",
                "t": self.key.written_at.isoformat(),
                "b": self.key.batch_id,
                "d": "newer" if self.newer else "older",
            }
        )

    @classmethod
    def decode(cls, cursor: str) -> BatchCursor:
        payload = decode_cursor(cursor)
        batch_id, stamp, way = payload.get("b"), payload.get("t"), payload.get("d")
        if (
            payload.get("k") != "batches"
            or not isinstance(batch_id, str)
            or not plain_text(batch_id)
            or not isinstance(stamp, str)
            or way not in ("newer", "older")
        ):
            raise BadCursor("not a cursor returned by this endpoint")
        try:
            written_at = dt.datetime.fromisoformat(stamp)
            if written_at.tzinfo is None:
                raise ValueError(stamp)
            written_at = written_at.astimezone(dt.UTC)
        except (ValueError, OverflowError):
            raise BadCursor("not a cursor returned by this endpoint") from None
        return cls(key=BatchKey(written_at=written_at, batch_id=batch_id), newer=way == "newer")


@dataclass(frozen=True, slots=True)
class BatchPage:
    """One page of batches, newest first, with the links both ways (None: nothing that way)."""

    items: list[BatchSummary]
    older_cursor: str | None
    newer_cursor: str | None


def list_batches(
    engine: Engine,
    *,
    limit: int,
    cursor: BatchCursor | None = None,
    status: Status | None = None,
    timings: bool = True,
) -> BatchPage:
    """Batches newest first (by their latest write, ties by ``batch_id``), a page at a time
    either way from ``cursor``; with ``status``, only batches holding a row in that status.
    ``timings=False`` (the console's list): summaries without the published and confirmed
    times, read from indexes only (:func:`_tallies`).

    Cost: a page keys every distinct batch id (one probe of ``ix_outbox_batch_written`` each,
    then a sort), then counts the rows of its own batches. Measured on PostgreSQL with
    1,000,000 rows: 101 batches of 10,000 rows, a few ms to key them; 100,000 batches of 10
    rows, 1.3-1.7 s a page. An outbox with that many batch ids needs its batches keyed by a
    table of their own (``outbox_batches`` with an index on its write time, kept for every
    source), not by walking the outbox."""
    newer = cursor is not None and cursor.newer
    with _snapshot(engine) as conn:
        keys = _page_batch_keys(
            conn,
            before=cursor.key if cursor and not newer else None,
            after=cursor.key if cursor and newer else None,
            status=status,
            limit=limit + 1,
        )
        more = len(keys) > limit
        keys = (keys[1:] if newer else keys[:limit]) if more else keys
        items = _summaries(conn, [k.batch_id for k in keys], timings=timings)
    if not keys:
        return BatchPage(items=[], older_cursor=None, newer_cursor=None)
    older = more if not newer else True
    newer_exists = more if newer else cursor is not None
    return BatchPage(
        items=items,
        older_cursor=BatchCursor(key=keys[-1], newer=False).encode() if older else None,
        newer_cursor=BatchCursor(key=keys[0], newer=True).encode() if newer_exists else None,
    )


def batch_summary(engine: Engine, *, batch_id: str) -> BatchSummary | None:
    with engine.connect() as conn:
        found = _summaries(conn, [batch_id])
    return found[0] if found else None


# ---------------------------------------------------------------------------- messages


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


#: Text columns a reader sees cut at :data:`~app.outbox.shown.MAX_SHOWN_TEXT` characters.
_SHOWN_TEXT = (
    "message_id",
    "batch_id",
    "exchange",
    "routing_key",
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
        elif c.name != "body":
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
    values["headers"] = _as_dict(values["headers"])
    values["properties"] = _as_dict(values["properties"])
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
        (outbox.c.ordering_key, flt.ordering_key),
    ):
        if value is not None:
            conds.append(column == value)
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


#: Most bytes of row text one page of messages carries (headers, properties, reasons): a page
#: stops before the row that would pass it (always holding one row), and says so.
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
            headers=_as_dict(values["headers"]),
            properties=_as_dict(values["properties"]),
        )
        out.append(MessageRecord(**values))
    return MessageSlice(items=out, truncated=taken < len(measured))


def _as_dict(value: Any) -> dict[str, Any] | None:
    """A JSON column as an object: producers may have stored anything (a non-object is shown
    wrapped, an unreadable document as the reason)."""
    if isinstance(value, dict):  # already the reason it cannot be shown (shown.marked)
        return value
    try:
        doc = load_document(value, what="document", max_bytes=MAX_SHOWN_DOCUMENT)
    except ContentError as exc:
        return {"unreadable": str(exc)}
    if doc is None or isinstance(doc, dict):
        return doc
    return {"value": doc}


# ------------------------------------------------------------------------------- audit


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    at: dt.datetime
    actor: str
    action: str
    request_id: str | None
    filter: dict[str, Any]
    count: int


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    at: dt.datetime
    actor: str
    principal: str | None
    client_addr: str | None
    action: str
    request_id: str | None
    filter: dict[str, Any]
    count: int


def audit_trail(engine: Engine, *, limit: int = 50, before: int | None = None) -> list[AuditEntry]:
    """Operator actions, newest first (keyset pages: ``before`` the last id of the previous)."""
    stmt = select(audit).order_by(audit.c.id.desc()).limit(limit)
    if before is not None:
        stmt = stmt.where(audit.c.id < before)
    with engine.connect() as conn:
        rows = conn.execute(stmt).mappings().all()
    return [
        AuditEntry(
            id=r["id"],
            at=r["at"],
            actor=r["actor"],
            principal=r["principal"],
            client_addr=r["client_addr"],
            action=r["action"],
            request_id=r["request_id"],
            filter=_as_dict(r["filter"]) or {},
            count=r["count"],
        )
        for r in rows
    ]


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
    return [
        WriterReject(
            id=r["id"],
            batch_id=r["batch_id"],
            sink=r["sink"],
            message_id=r["message_id"],
            reason=r["reason"],
            row_json=r["row_json"],
            created_at=r["created_at"],
        )
        for r in rows
    ]


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
        shapes.setdefault(reason_shape(reason), []).append((reason, int(count), _as_utc(last)))
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


@dataclass(frozen=True, slots=True)
class FailureGroup:
    """Terminal failures sharing a cause: status, exchange, routing key and reason."""

    status: Status
    exchange: str
    routing_key: str
    reason: str
    rows: int
    first_created: dt.datetime | None
    last_created: dt.datetime | None
    sample_message_id: str


def failures_by_cause(engine: Engine, *, limit: int = 50) -> list[FailureGroup]:
    """Returned, nacked and failed rows grouped by cause, largest group first (served by the
    status index: terminal failures are few next to confirmed rows)."""
    reason = func.coalesce(outbox.c.last_error, outbox.c.reply_text, "")
    stmt = (
        select(
            outbox.c.status,
            outbox.c.exchange,
            outbox.c.routing_key,
            reason.label("reason"),
            func.count().label("n"),
            func.min(outbox.c.created_at).label("first"),
            func.max(outbox.c.created_at).label("last"),
            func.min(outbox.c.message_id).label("sample"),
        )
        .where(outbox.c.status.in_([s.value for s in TERMINAL_FAILURES]))
        .group_by(outbox.c.status, outbox.c.exchange, outbox.c.routing_key, reason)
        .order_by(func.count().desc(), outbox.c.exchange)
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
    """Terminal failures with one cause: status, exchange and reason (:func:`cause_of`), with
    the breakdown by routing key (the largest ``keys`` first; the rest summed in ``more_*``)."""

    status: Status
    exchange: str
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
    return [outbox.c.status, outbox.c.exchange, cause_of()]


def failures_page(
    engine: Engine, *, limit: int = 50, offset: int = 0, keys_per_group: int = 20
) -> FailuresPage:
    """Terminal failures by cause, largest first, one page of causes at a time, with the
    totals over every cause (read in one snapshot on PostgreSQL: the page's figures and its
    totals are the same moment's)."""
    terminal = outbox.c.status.in_(sorted(s.value for s in TERMINAL_FAILURES))
    cause = cause_of().label("cause")
    grouped = (
        select(outbox.c.status, outbox.c.exchange, cause).where(terminal).group_by(*_cause_key())
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
        .order_by(func.count().desc(), outbox.c.status, outbox.c.exchange, cause_of())
        .limit(limit)
        .offset(offset)
    )
    with _snapshot(engine) as conn:
        n_groups, n_rows = conn.execute(totals).one()
        rows = conn.execute(page).all()
        keys = _keys_of(conn, [(r.status, r.exchange, r.cause) for r in rows]) if rows else {}
    groups = []
    for r in rows:
        every = keys.get((r.status, r.exchange, r.cause), [])
        shown, rest = every[:keys_per_group], every[keys_per_group:]
        groups.append(
            CauseGroup(
                status=Status(r.status),
                exchange=r.exchange,
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


def _keys_of(
    conn: Connection, causes: Sequence[tuple[str, str, str]]
) -> dict[tuple[str, str, str], list[KeyCount]]:
    """The routing keys of these causes, largest first."""
    cause = cause_of()
    which = or_(
        *[and_(outbox.c.status == st, outbox.c.exchange == ex, cause == c) for st, ex, c in causes]
    )
    stmt = (
        select(
            outbox.c.status,
            outbox.c.exchange,
            cause.label("cause"),
            outbox.c.routing_key,
            func.count().label("n"),
            func.min(outbox.c.message_id).label("sample"),
        )
        .where(which)
        .group_by(*_cause_key(), outbox.c.routing_key)
        .order_by(func.count().desc(), outbox.c.routing_key)
    )
    out: dict[tuple[str, str, str], list[KeyCount]] = {}
    for r in conn.execute(stmt):
        out.setdefault((r.status, r.exchange, r.cause), []).append(
            KeyCount(routing_key=r.routing_key, rows=int(r.n), sample_message_id=r.sample)
        )
    return out


def _snapshot(engine: Engine) -> Connection:
    """A connection whose statements all see one snapshot (PostgreSQL's repeatable read; a
    SQLite read transaction is one snapshot already)."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
    return conn


def count_scope(engine: Engine, *, flt: Scope, cap: int = 10_000) -> tuple[int, bool]:
    """How many rows match ``flt``, counted up to ``cap`` (True: there are more)."""
    conds = scope_conditions(flt)
    capped = select(outbox.c.id).where(and_(*conds) if conds else true()).limit(cap + 1)
    with engine.connect() as conn:
        n = int(conn.execute(select(func.count()).select_from(capped.subquery())).scalar_one())
    return min(n, cap), n > cap


def audit_by_request_id(engine: Engine, *, request_id: str) -> AuditRecord | None:
    stmt = select(audit).where(audit.c.request_id == request_id)
    with engine.connect() as conn:
        row = conn.execute(stmt).mappings().first()
    if row is None:
        return None
    return AuditRecord(
        id=row["id"],
        at=row["at"],
        actor=row["actor"],
        action=row["action"],
        request_id=row["request_id"],
        filter=dict(row["filter"] or {}),
        count=row["count"],
    )


def batch_exists(engine: Engine, *, batch_id: str) -> bool:
    in_rows = select(outbox.c.id).where(outbox.c.batch_id == batch_id).limit(1)
    recorded = select(batches.c.batch_id).where(batches.c.batch_id == batch_id)
    with engine.connect() as conn:
        return (
            conn.execute(in_rows).first() is not None or conn.execute(recorded).first() is not None
        )


# ------------------------------------------------------------------------- parked keys


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


# ----------------------------------------------------------------------------- metrics


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    counts: dict[Status, int]
    oldest_pending_age_seconds: float | None
    oldest_in_flight_age_seconds: float | None
    possible_duplicates: int
    operator_republished: int
    publishers_alive: int
    publishers_known: int
    parked: int = 0
    oldest_parked_age_seconds: float | None = None
    delayed: int = 0
    upkeep: Upkeep | None = None


def metrics_snapshot(engine: Engine, *, now: dt.datetime, alive_after: float) -> MetricsSnapshot:
    """The figures the API's ``/metrics`` exposes: what the database knows, nothing more."""
    with engine.connect() as conn:
        pending_age, in_flight_age = oldest_ages(conn, now=now)
        pubs = conn.execute(select(publishers.c.heartbeat_at, publishers.c.stopped_at)).all()
        alive = sum(
            1
            for beat, stopped in pubs
            if stopped is None and (age_seconds(beat, now) or 0.0) <= alive_after
        )
        counts, lost, _estimated = status_counts(conn)
        parked, parked_age = parked_rows(conn, now=now)
        delayed, _next = delayed_rows(conn, now=now)
        return MetricsSnapshot(
            counts=counts,
            oldest_pending_age_seconds=pending_age,
            oldest_in_flight_age_seconds=in_flight_age,
            possible_duplicates=lost,
            operator_republished=operator_republished(conn),
            publishers_alive=alive,
            publishers_known=len(pubs),
            parked=parked,
            oldest_parked_age_seconds=parked_age,
            delayed=delayed,
            upkeep=table_upkeep(conn),
        )


# ------------------------------------------------------------------------------ rates

#: The overview's charts: this long, in one-minute steps ending now.
RATE_WINDOW = dt.timedelta(hours=1)
#: Samples this long before the window are read too: each publisher's last one before it is
#: the baseline of its first difference (the longest sample interval is an hour).
SAMPLE_BASELINE = dt.timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Rates:
    """Rows per minute over a window ending at ``end``, from the publishers' samples
    (``outbox_samples``): written (the rise of the outbox's highest id), confirmed and failed
    (a return, a final nack or a failure) as the differences of each publisher's counters
    between consecutive samples, and the confirm latency of each minute (p50: the samples'
    median weighted by their confirms; p99: the highest). Index ``i`` of each list is the minute
    ``(start + i min, start + (i + 1) min]``; a difference counts in its later sample's minute.
    ``sampled``: some publisher recorded figures in the window (without, the rates are blind).
    Cost: the samples of the window and its baseline (one per publisher and sample interval),
    whatever the traffic."""

    start: dt.datetime
    end: dt.datetime
    written: list[int]
    confirmed: list[int]
    failed: list[int]
    latency_p50_ms: list[float | None]
    latency_p99_ms: list[float | None]
    sampled: bool


def rates(engine: Engine, *, now: dt.datetime, window: dt.timedelta = RATE_WINDOW) -> Rates:
    minutes = max(1, int(window.total_seconds() // 60))
    start = now - dt.timedelta(minutes=minutes)
    stmt = (
        select(samples)
        .where(samples.c.at >= start - SAMPLE_BASELINE, samples.c.at <= now)
        .order_by(samples.c.at, samples.c.publisher_id)
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    written, confirmed, failed = [0] * minutes, [0] * minutes, [0] * minutes
    p50s: list[list[tuple[float, int]]] = [[] for _ in range(minutes)]
    p99: list[float | None] = [None] * minutes

    def minute(at: dt.datetime) -> int | None:
        """The minute a sample closes: the one that ends at or after it (a sample at the
        window's end closes its last minute)."""
        i = math.ceil((at - start).total_seconds() / 60) - 1
        return i if 0 <= i < minutes else None

    last: dict[str, Any] = {}
    top: int | None = None
    sampled = False
    for row in rows:
        i = minute(row.at)
        sampled = sampled or i is not None
        before = last.get(row.publisher_id)
        last[row.publisher_id] = row
        if row.max_id is not None:
            if i is not None and top is not None and row.max_id > top:
                written[i] += row.max_id - top
            top = row.max_id if top is None else max(top, row.max_id)
        if i is None or before is None:
            continue
        done = max(0, row.confirmed - before.confirmed)
        confirmed[i] += done
        failed[i] += max(0, row.failed - before.failed)
        if row.latency_p50_ms is not None:
            p50s[i].append((row.latency_p50_ms, max(1, done)))
        if row.latency_p99_ms is not None:
            p99[i] = max(p99[i] or 0.0, row.latency_p99_ms)
    return Rates(
        start=start,
        end=now,
        written=written,
        confirmed=confirmed,
        failed=failed,
        latency_p50_ms=[_weighted_median(m) for m in p50s],
        latency_p99_ms=p99,
        sampled=sampled,
    )


def _weighted_median(values: list[tuple[float, int]]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    half, running = sum(w for _, w in ordered) / 2, 0
    for value, weight in ordered:
        running += weight
        if running >= half:
            return value
    return ordered[-1][0]  # pragma: no cover (the loop reaches half)
