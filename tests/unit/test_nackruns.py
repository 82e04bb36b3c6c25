"""The verdict on nacks (pure): the rows' fault among acks, or a destination outage."""

from __future__ import annotations

from app.publisher.nackruns import NackRuns


def test_an_ack_to_the_same_exchange_charges_the_run_to_its_rows() -> None:
    runs = NackRuns(burst=3)
    assert not runs.nacked("ex", [1, 2], now=0.0)
    assert runs.acked("other") == []  # another exchange's ack says nothing of this one
    assert runs.acked("ex") == [1, 2]
    assert not runs and runs.waiting() == 0


def test_a_burst_with_no_ack_between_is_an_outage() -> None:
    runs = NackRuns(burst=3)
    runs.nacked("ex", [1], now=0.0)
    runs.nacked("b", [9], now=0.0)
    verdict = runs.nacked("ex", [2, 3], now=0.1)
    assert verdict.outage == {"ex": [1, 2, 3]} and verdict.charged == []
    assert runs.waiting() == 1  # b's run stays open


def test_a_short_run_is_charged_after_the_verdict_delay() -> None:
    runs = NackRuns(burst=20, verdict_after=1.0)
    runs.nacked("ex", [1, 2], now=10.0)
    assert runs.next_due() == 11.0
    assert runs.due(10.5) == []
    assert runs.due(11.0) == [1, 2]
    assert runs.next_due() is None


def test_dropped_rows_leave_their_run() -> None:
    runs = NackRuns(burst=5)
    runs.nacked("ex", [1, 2], now=0.0)
    runs.drop({1, 2})
    assert not runs
