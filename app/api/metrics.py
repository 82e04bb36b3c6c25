"""``/metrics``: Prometheus text, built per request from the database (no global registry).

Only what the database knows: rows per status, the oldest ages, possible duplicates, live
publishers, operator republishes, and on PostgreSQL the outbox table's size, dead rows and
last vacuum (``outbox_table_*``). Counters of what the publishers *did* (publishes, confirms,
nacks, closes, the confirm-latency histogram) are each publisher's own, served on its own port
(``outbox_publisher_*``, :mod:`app.publisher.metrics`) and summed by Prometheus: never rebuilt
from a table, never lowered by a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.api.auth import require_metrics
from app.api.context import ApiContext, get_ctx
from app.api.models import ErrorBody
from app.outbox.read.metrics import MetricsSnapshot, metrics_snapshot
from app.outbox.states import Status


class SnapshotCollector(Collector):
    """Yields the metric families of one :class:`MetricsSnapshot`."""

    def __init__(self, snap: MetricsSnapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        snap = self.snap
        yield CounterMetricFamily(
            "outbox_republished",
            "Rows operators moved back to pending.",
            value=snap.operator_republished,
        )
        rows = GaugeMetricFamily("outbox_rows", "Outbox rows per status.", labels=["status"])
        for status, count in snap.counts.items():
            rows.add_metric([status.value], count)
        yield rows
        yield from self._gauges()
        yield from self._upkeep()

    def _upkeep(self) -> Iterator[Metric]:
        u = self.snap.upkeep
        if u is None:  # SQLite
            return
        yield GaugeMetricFamily(
            "outbox_table_live_rows",
            "Live rows of the outbox table (PostgreSQL's statistics' estimate).",
            value=u.live_rows,
        )
        yield GaugeMetricFamily(
            "outbox_table_dead_rows",
            "Dead row versions of the outbox table not yet vacuumed.",
            value=u.dead_rows,
        )
        size = GaugeMetricFamily(
            "outbox_table_size_bytes", "The outbox table on disk.", labels=["part"]
        )
        size.add_metric(["table"], u.table_bytes)
        size.add_metric(["indexes"], u.index_bytes)
        yield size
        yield GaugeMetricFamily(
            "outbox_table_last_vacuum_timestamp_seconds",
            "When the outbox was last vacuumed, by autovacuum or by hand (0: never).",
            value=u.last_vacuum_at.timestamp() if u.last_vacuum_at else 0.0,
        )
        yield CounterMetricFamily(
            "outbox_table_autovacuums",
            "Autovacuums of the outbox since PostgreSQL's statistics began.",
            value=u.autovacuum_runs,
        )

    def _gauges(self) -> Iterator[Metric]:
        snap = self.snap
        yield GaugeMetricFamily(
            "outbox_in_flight",
            "Rows claimed and awaiting a confirm.",
            value=snap.counts.get(Status.IN_FLIGHT, 0),
        )
        yield GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending row (0 when none).",
            value=snap.oldest_pending_age_seconds or 0.0,
        )
        yield GaugeMetricFamily(
            "outbox_oldest_in_flight_age_seconds",
            "Age of the oldest unconfirmed publish (0 when none).",
            value=snap.oldest_in_flight_age_seconds or 0.0,
        )
        yield GaugeMetricFamily(
            "outbox_possible_duplicates",
            "Sum of lost confirms over present rows for exchanges: publishes that may have been "
            "duplicated (a stream's rows are exactly once: the broker drops a repeated id).",
            value=snap.possible_duplicates,
        )
        yield GaugeMetricFamily(
            "outbox_publishers_alive",
            "Publishers with a recent heartbeat, not stopped.",
            value=snap.publishers_alive,
        )
        yield GaugeMetricFamily(
            "outbox_parked_rows",
            "Pending rows of Spark batches in fail mode not recorded yet (held or parked).",
            value=snap.parked,
        )
        yield GaugeMetricFamily(
            "outbox_delayed_rows",
            "Pending rows whose delivery time (not_before) is still ahead: delayed, not late.",
            value=snap.delayed,
        )
        yield GaugeMetricFamily(
            "outbox_oldest_parked_age_seconds",
            "Age of the oldest parked row (0 when none): a driver died before its commit.",
            value=snap.oldest_parked_age_seconds or 0.0,
        )


def render(snap: MetricsSnapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))
    return generate_latest(registry)


router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    dependencies=[Depends(require_metrics)],
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition.",
        },
        401: {"model": ErrorBody, "description": "Missing or unknown bearer token."},
        429: {"model": ErrorBody, "description": "Too many failed authentications."},
        503: {"model": ErrorBody, "description": "The database is unreachable."},
    },
    summary="Prometheus metrics",
)
def get_metrics(ctx: Annotated[ApiContext, Depends(get_ctx)]) -> Response:
    snap = metrics_snapshot(ctx.engine, now=ctx.now(), alive_after=ctx.alive_after)
    return Response(render(snap), media_type=CONTENT_TYPE_LATEST)
