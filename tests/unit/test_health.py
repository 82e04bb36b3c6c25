"""The monitoring verdict (outbox status --check): pure rules on the outbox's figures."""

from __future__ import annotations

from app.outbox.health import Level, Thresholds, verdict
from app.outbox.states import Status
from tests.support.health import stats


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
