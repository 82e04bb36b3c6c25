"""The outbox's figures for ``GET /v1/stats``, ``outbox status`` and the console's overview:
rows per status, oldest ages, parked and delayed rows, confirm latency, publishers and the
table's upkeep, read in one transaction (:func:`read_stats`). :mod:`app.outbox.health` judges
them; :mod:`app.outbox.read.metrics` exports the same queries' figures.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, case, func, or_, select, text

from app.outbox.planner import written
from app.outbox.read.figures import age_seconds, percentile
from app.outbox.read.sql import ASIDE, from_row, held_since
from app.outbox.reports import PublisherReport, read_report
from app.outbox.schema import audit, held, outbox, publishers
from app.outbox.states import Status
from app.outbox.upkeep import Upkeep
from app.settings import Settings


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


#: On PostgreSQL, above this many rows (its own estimate) the ``confirmed`` count is estimated
#: from the planner's statistics instead of counted: every other count stays exact and reads
#: only its own small partial index.
EXACT_CONFIRMED_UP_TO = 200_000


def status_counts(conn: Connection) -> tuple[dict[Status, int], int, bool]:
    """Rows per status (every status present, zero when none), the sum of ``lost_confirms``
    over exchange rows (possible duplicates; a stream's rows are exactly once), and whether
    ``confirmed`` is an estimate. Each count reads a partial index (pending: ``ix_outbox_due``,
    in flight: ``ix_outbox_lease``, set aside: ``ix_outbox_aside``, lost confirms:
    ``ix_outbox_lost``); only ``confirmed`` would read the whole table, so on a large
    PostgreSQL outbox it is the table's estimated size minus the rest (labelled as such)."""
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
        outbox.c.lost_confirms > written(0),  # ix_outbox_lost's predicate
        # a stream's resends go out under the same publishing id, which the broker drops:
        # exactly once, never a duplicate (app/streams)
        outbox.c.stream.is_(None),
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
    in_flight = select(func.min(held_since())).where(outbox.c.status == Status.IN_FLIGHT)
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
        alive = row["stopped_at"] is None and beat_age <= alive_after
        out.append(from_row(PublisherInfo, row, stats=stats, alive=alive))
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


def alive_after(settings: Settings) -> float:
    """A publisher that beat within this many seconds (and did not stop) counts as alive:
    three heartbeat intervals."""
    return 3 * settings.publisher_heartbeat_interval


def stats_for(engine: Engine, *, settings: Settings, now: dt.datetime) -> OutboxStats:
    """:func:`read_stats` with the settings' alive rule and latency window: what
    ``GET /v1/stats``, the console's overview and ``outbox status`` show alike."""
    return read_stats(
        engine,
        now=now,
        alive_after=alive_after(settings),
        latency_window=dt.timedelta(seconds=settings.stats_latency_window),
        latency_rows=settings.stats_latency_rows,
    )


def summarize_latency(ordered: Sequence[float], *, window: dt.timedelta) -> LatencySummary:
    return LatencySummary(
        window_seconds=window.total_seconds(),
        samples=len(ordered),
        p50=percentile(ordered, 0.5),
        p90=percentile(ordered, 0.9),
        p99=percentile(ordered, 0.99),
    )
