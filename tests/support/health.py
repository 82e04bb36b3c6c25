"""An outbox's figures as the health rules read them: a fixed now and a stats record to vary."""

from __future__ import annotations

import datetime as dt

from app.outbox.read.stats import LatencySummary, OutboxStats, PublisherInfo
from app.outbox.reports import PublisherReport
from app.outbox.states import Status

NOW = dt.datetime(2026, 11, 24, tzinfo=dt.UTC)


def stats(
    *,
    counts: dict[Status, int] | None = None,
    pending_age: float | None = None,
    in_flight_age: float | None = None,
    alive: bool = True,
    blocked: bool = False,
) -> OutboxStats:
    report = PublisherReport(blocked=blocked).model_dump(mode="json")
    pub = PublisherInfo(
        publisher_id="p",
        hostname="h",
        pid=1,
        started_at=NOW,
        heartbeat_at=NOW,
        stopped_at=None,
        alive=alive,
        stats=report,
    )
    lat = LatencySummary(window_seconds=60, samples=0, p50=None, p90=None, p99=None)
    return OutboxStats(
        at=NOW,
        counts=counts or {},
        oldest_pending_age_seconds=pending_age,
        oldest_in_flight_age_seconds=in_flight_age,
        confirm_latency=lat,
        possible_duplicates=0,
        operator_republished=0,
        publishers=[pub],
    )
