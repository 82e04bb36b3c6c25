"""A broker outage is logged once, reminded at most once a minute, and ended with its length
(pure: :class:`~app.publisher.unreachable.BrokerOutage` with a fake clock, no loop, no socket)."""

from __future__ import annotations

import logging

import pytest

from app.publisher.unreachable import REMINDER, BrokerOutage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def _fail_for(outage: BrokerOutage, clock: Clock, *, seconds: float, every: float) -> int:
    """Failed attempts every ``every`` seconds for ``seconds``; returns how many."""
    attempts = 0
    end = clock.now + seconds
    while clock.now < end:
        outage.failed(broker="amqp://b:5672/", error="Connection refused", retry_in=every)
        attempts += 1
        clock.now += every
    return attempts


def test_ten_minutes_of_failed_attempts_log_a_dozen_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    outage = BrokerOutage(clock=clock)
    outage.connected()  # the first connection
    clock.now += 30
    outage.disconnected()
    caplog.set_level(logging.DEBUG, logger="app.publisher")
    attempts = _fail_for(outage, clock, seconds=600, every=10)
    assert attempts == 60
    lines = _lines(caplog)
    assert len(lines) == 1 + 600 // int(REMINDER) - 1  # the first, then one a minute
    assert lines[0].startswith("cannot connect to the broker at amqp://b:5672/: Connection refused")
    assert all(line.startswith("broker still unreachable after") for line in lines[1:])
    assert "after 60s, 7 attempts" in lines[1]
    assert len(_lines(caplog, logging.DEBUG)) == attempts  # each attempt still at DEBUG
    outage.connected()
    end = _lines(caplog)[-1]
    assert end == "the broker answers again after 600.0s (60 connection attempts failed meanwhile)"
    assert outage.seconds() == 0.0


def test_the_outage_dates_from_the_lost_connection(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    outage = BrokerOutage(clock=clock)
    outage.connected()
    outage.disconnected()
    clock.now += 2.5  # an immediate reconnect failed after the setup timeout
    caplog.set_level(logging.INFO, logger="app.publisher")
    outage.failed(broker="b", error="timed out", retry_in=0.1)
    assert outage.seconds() == 2.5
    clock.now += 4
    assert outage.seconds() == 6.5
    outage.connected()
    assert "after 6.5s (1 connection attempts failed" in _lines(caplog)[-1]


def test_a_reconnect_that_works_logs_no_outage(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    outage = BrokerOutage(clock=clock)
    outage.connected()
    caplog.set_level(logging.DEBUG, logger="app.publisher")
    outage.disconnected()
    clock.now += 0.2
    outage.connected()
    assert _lines(caplog, logging.DEBUG) == []
    assert outage.seconds() == 0.0


def test_a_publisher_started_without_a_broker_counts_from_its_start() -> None:
    clock = Clock()
    outage = BrokerOutage(clock=clock)
    clock.now += 3
    outage.failed(broker="b", error="refused", retry_in=1)
    clock.now += 1
    assert outage.seconds() == 4.0
    assert outage.attempts == 1
