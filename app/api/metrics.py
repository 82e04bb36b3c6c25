"""``/metrics``: Prometheus text, built per request from the database (no global registry).

Counters are the publishers' own (``outbox_publishers.stats``, monotonic per publisher) summed
over every publisher row; gauges come from the outbox table itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.api.auth import require_reader
from app.api.context import ApiContext, get_ctx
from app.api.models import ErrorBody
from app.outbox.queries import MetricsSnapshot, metrics_snapshot
from app.outbox.states import Status

#: counter key in publisher stats -> (metric name without _total, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "published": ("outbox_published", "Publishes sent to the broker (republishes included)."),
    "confirmed": ("outbox_confirmed", "Publishes the broker confirmed (acked, not returned)."),
    "nacked": ("outbox_nacked", "Publishes the broker nacked."),
    "returned": ("outbox_returned", "Mandatory publishes returned unroutable."),
    "failed": ("outbox_failed", "Rows ended failed (permanent error)."),
    "lost_confirms": (
        "outbox_lost_confirms",
        "Publishes whose confirm never came (channel or connection lost); each is republished: "
        "a possible duplicate.",
    ),
    "channel_closes": ("outbox_channel_closes", "Confirm channels lost or closed by the broker."),
    "reconnects": ("outbox_reconnects", "Broker reconnects."),
    "protocol_errors": ("outbox_protocol_errors", "Impossible frames from the broker."),
    "blocked_seconds": ("outbox_blocked_seconds", "Time publishing was blocked by the broker."),
}


class SnapshotCollector(Collector):
    """Yields the metric families of one :class:`MetricsSnapshot`."""

    def __init__(self, snap: MetricsSnapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        snap = self.snap
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=snap.counters.get(key, 0.0))
        yield CounterMetricFamily(
            "outbox_republished", "Rows operators moved back to pending.",
            value=snap.operator_republished,
        )  # fmt: skip
        rows = GaugeMetricFamily("outbox_rows", "Outbox rows per status.", labels=["status"])
        for status, count in snap.counts.items():
            rows.add_metric([status.value], count)
        yield rows
        yield from self._gauges()
        yield self._latency()

    def _gauges(self) -> Iterator[Metric]:
        snap = self.snap
        yield GaugeMetricFamily(
            "outbox_in_flight", "Rows claimed and awaiting a confirm.",
            value=snap.counts.get(Status.IN_FLIGHT, 0),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds", "Age of the oldest pending row (0 when none).",
            value=snap.oldest_pending_age_seconds or 0.0,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "outbox_oldest_in_flight_age_seconds",
            "Age of the oldest unconfirmed publish (0 when none).",
            value=snap.oldest_in_flight_age_seconds or 0.0,
        )
        yield GaugeMetricFamily(
            "outbox_possible_duplicates",
            "Sum of lost confirms over present rows: publishes that may have been duplicated.",
            value=snap.possible_duplicates,
        )
        yield GaugeMetricFamily(
            "outbox_publishers_alive", "Publishers with a recent heartbeat, not stopped.",
            value=snap.publishers_alive,
        )  # fmt: skip

    def _latency(self) -> Metric:
        hist = self.snap.confirm_latency
        buckets = [("+Inf" if math.isinf(u) else repr(u), c) for u, c in hist.buckets]
        return HistogramMetricFamily(
            "outbox_confirm_latency_seconds",
            "Publish-to-confirm latency, merged over publishers.",
            buckets=buckets,
            sum_value=hist.sum,
        )


def render(snap: MetricsSnapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))
    return generate_latest(registry)


router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    dependencies=[Depends(require_reader)],
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "description": "Prometheus text exposition."},
        401: {"model": ErrorBody, "description": "Missing or unknown bearer token."},
        503: {"model": ErrorBody, "description": "The database is unreachable."},
    },
    summary="Prometheus metrics",
)  # fmt: skip
def get_metrics(ctx: Annotated[ApiContext, Depends(get_ctx)]) -> Response:
    snap = metrics_snapshot(ctx.engine, now=ctx.now(), alive_after=ctx.alive_after)
    return Response(render(snap), media_type=CONTENT_TYPE_LATEST)
