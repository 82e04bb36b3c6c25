"""The monitoring verdict (outbox status --check): pure rules on the outbox's figures."""

from __future__ import annotations

import datetime as dt

from app.outbox.health import Level, Thresholds, verdict
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


def test_ok_warning_critical() -> None:
    assert verdict(stats()).level is Level.OK
    assert verdict(stats(pending_age=90)).level is Level.WARNING
    assert verdict(stats(pending_age=400)).level is Level.CRITICAL
    assert verdict(stats(in_flight_age=40)).level is Level.WARNING
    assert verdict(stats(counts={Status.FAILED: 3})).level is Level.WARNING
    assert verdict(stats(blocked=True)).level is Level.CRITICAL
    down = verdict(stats(counts={Status.PENDING: 5}, alive=False))
    assert down.level is Level.CRITICAL and "no publisher alive" in down.line()
    strict = Thresholds(warn_pending_age=1, crit_pending_age=2)
    assert verdict(stats(pending_age=1.5), strict).level is Level.WARNING
