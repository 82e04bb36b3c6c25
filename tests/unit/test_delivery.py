"""``wait="confirmed"``'s decisions, without Spark or a database: when a batch's rows are settled,
when to look for rows blocked behind a failed row of their key, how long to pause between
polls, what the summary and the error say, and the options as untrusted input."""

from __future__ import annotations

import math
from typing import Any

import pytest

from spark_writer import OutboxConfigError, OutboxDeliveryError
from spark_writer.delivery import (
    Poll,
    Reason,
    delivery_of,
    look_for_blocked,
    next_interval,
    settled,
)
from spark_writer.options import from_spark_options, options_of

BASE = {"url": "sqlite:////tmp/o.db", "sink": "orders", "exchange": "x", "routing_key": "k"}


@pytest.mark.parametrize(
    ("counts", "blocked", "done"),
    [
        ({"confirmed": 5}, None, True),
        ({"confirmed": 3, "returned": 1, "nacked": 1, "failed": 0, "skipped": 1}, None, True),
        ({"confirmed": 4, "pending": 1}, None, False),  # a row retrying after a nack
        ({"confirmed": 4, "in_flight": 1}, None, False),
        ({"returned": 1, "pending": 3}, 3, True),  # every open row blocked behind the return
        ({"returned": 1, "pending": 3, "in_flight": 1}, 3, False),
        ({}, None, True),  # every row rejected, or a replay of another batch's rows
    ],
)
def test_a_batch_is_settled_when_no_row_can_still_move(
    counts: dict[str, int], blocked: int | None, done: bool
) -> None:
    assert settled(Poll(counts=counts, blocked=blocked)) is done


def test_blocked_rows_are_looked_for_after_a_failure_or_when_nothing_moved() -> None:
    moving = Poll(counts={"pending": 5, "confirmed": 1})
    assert not look_for_blocked(moving, None)
    assert not look_for_blocked(Poll(counts={"pending": 4, "confirmed": 2}), moving)
    assert look_for_blocked(Poll(counts={"pending": 5, "confirmed": 1}), moving)  # stalled
    assert look_for_blocked(Poll(counts={"pending": 5, "failed": 1}), None)
    assert not look_for_blocked(Poll(counts={"confirmed": 5, "failed": 1}), None)  # none open


def test_the_pause_grows_to_half_a_second_and_stays_ten_times_the_query() -> None:
    pauses = [0.05]
    for _ in range(10):
        pauses.append(next_interval(pauses[-1], query_seconds=0.001))
    assert pauses[1] == pytest.approx(0.075) and pauses[-1] == 0.5
    assert next_interval(0.05, query_seconds=0.3) == pytest.approx(3.0)


def test_an_operators_skip_settles_a_row_without_failing_the_wait() -> None:
    skipped = delivery_of("orders:5", Poll(counts={"confirmed": 9, "skipped": 1}))
    assert skipped.ok and skipped.undelivered == 0
    assert skipped.counts() == "10 row(s): 9 confirmed, 1 skipped"
    returned = delivery_of("orders:6", Poll(counts={"confirmed": 9, "returned": 1}))
    assert not returned.ok and returned.undelivered == 1


def test_the_summary_and_the_errors_name_the_batch_and_the_counts() -> None:
    ok = delivery_of("orders:1", Poll(counts={"confirmed": 3}), waited=0.4)
    assert ok.ok and ok.counts() == "3 row(s): 3 confirmed"
    poll = Poll(counts={"confirmed": 6, "returned": 2, "pending": 2}, retrying=0, blocked=2)
    reason = Reason("returned", "312 NO_ROUTE", 2, "m7")
    bad = delivery_of("orders:2", poll, reasons=[reason], waited=1.2)
    assert not bad.ok and bad.undelivered == 2 and bad.open == 2
    assert str(OutboxDeliveryError(bad)) == (
        "batch orders:2: 4 of 10 row(s) not delivered: 10 row(s): 6 confirmed, 2 returned, "
        "2 pending (2 blocked behind a failed row of their key) (returned 312 NO_ROUTE: 2 "
        "row(s), first m7). The batch is recorded: re-running the job adds no row and waits "
        "again; republish with `outbox republish --batch orders:2`"
    )
    late = delivery_of("orders:3", Poll(counts={"pending": 4}), waited=30.0, timed_out=True)
    message = str(OutboxDeliveryError(late))
    assert message.startswith("batch orders:3: not settled after waiting 30.0s: 4 row(s)")
    assert "is a publisher running" in message and "republish" not in message
    retrying = delivery_of(
        "orders:4", Poll(counts={"pending": 1, "confirmed": 3}, retrying=1), timed_out=True
    )
    assert "1 pending (1 retrying)" in str(OutboxDeliveryError(retrying))
    assert "is a publisher running" not in str(OutboxDeliveryError(retrying))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"wait": "acked"}, r"wait must be one of \['written', 'confirmed'\], not 'acked'"),
        ({"wait": None}, "wait must be one of"),
        ({"wait_timeout": -1}, "wait_timeout must be a finite number of seconds above 0, not -1"),
        ({"wait_timeout": 0}, "above 0"),
        ({"wait_timeout": math.nan}, "above 0"),
        ({"wait_timeout": math.inf}, "above 0"),
        ({"wait_timeout": "30"}, "wait_timeout must be a number of seconds, not '30'"),
        ({"wait_timeout": True}, "a number of seconds"),
    ],
)
def test_bad_wait_options_get_a_clear_error(extra: dict[str, object], message: str) -> None:
    with pytest.raises(OutboxConfigError, match=message):
        options_of(None, {**BASE, **extra})


def test_data_source_wait_options_are_parsed_and_checked() -> None:
    options, _ = from_spark_options({**BASE, "wait": "Confirmed", "waitTimeout": "2.5"})
    assert (options.wait, options.wait_timeout) == ("confirmed", 2.5)
    assert options_of(None, BASE).wait == "written"  # the default stays "written"
    for raw, message in [
        ({"waitTimeout": "soon"}, "option 'waitTimeout' must be seconds, not 'soon'"),
        ({"wait_timeout": "-5"}, "above 0"),
        ({"wait": "yes"}, "wait must be one of"),
    ]:
        with pytest.raises(OutboxConfigError, match=message):
            from_spark_options({**BASE, **raw})


class _Conn:
    """A connection answering the wait's statements from a script: one poll's rows per call
    of the status count, and a fixed answer to the others."""

    def __init__(self, polls: list[list[tuple[str, int, int]]], blocked: int = 0) -> None:
        self.polls = polls
        self.blocked = blocked
        self.sent: list[str] = []

    def execute(self, sql: str, params: object) -> _Conn:
        if "GROUP BY status" in sql:
            self.sent.append("poll")
            self.rows: list[tuple[object, ...]] = self.polls.pop(0) if self.polls else []
        elif "EXISTS" in sql:
            self.sent.append("blocked")
            self.rows = [(self.blocked,)]
        else:
            self.sent.append("reasons")
            self.rows = [("returned", "312 NO_ROUTE", 1, "m0")]
        return self

    def fetchall(self) -> list[tuple[object, ...]]:
        return self.rows


class _Store:
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(round(seconds, 4))
        self.now += seconds


def wait(conn: _Conn, *, timeout: float = 10.0, stopped: Any = None) -> tuple[Any, _Clock]:
    from spark_writer.watch import await_delivery

    clock = _Clock()
    delivery = await_delivery(
        _Store(conn),  # type: ignore[arg-type]
        batch_key="b:1",
        timeout=timeout,
        stopped=stopped,
        clock=clock,
        sleep=clock.sleep,
    )
    return delivery, clock


def test_the_wait_polls_until_settled_with_growing_pauses() -> None:
    pending = [("pending", 2, 0), ("confirmed", 1, 1)]
    retrying = [("pending", 1, 1), ("confirmed", 2, 2)]
    conn = _Conn([pending, retrying, retrying, [("confirmed", 3, 3)]])
    delivery, clock = wait(conn)
    assert delivery.ok and delivery.confirmed == 3 and delivery.waited == pytest.approx(0.35625)
    assert clock.pauses == [0.075, 0.1125, 0.1688]
    # the third poll saw nothing move: it looked for blocked rows (none); no failure, no reasons
    assert conn.sent == ["poll", "poll", "poll", "blocked", "poll"]


def test_the_wait_ends_at_its_timeout_or_when_the_query_stops() -> None:
    stuck = [("pending", 3, 0)]
    late, clock = wait(_Conn([stuck] * 100), timeout=2.0)
    assert late.timed_out and not late.stopped and late.waited == pytest.approx(2.0)
    assert sum(clock.pauses) == pytest.approx(2.0) and max(clock.pauses) == 0.5
    asked = []
    halted, clock = wait(_Conn([stuck] * 100), stopped=lambda: asked.append(1) or len(asked) > 2)
    assert halted.stopped and not halted.timed_out and not halted.ok and len(clock.pauses) == 2
    assert "its streaming query was stopped after waiting" in str(OutboxDeliveryError(halted))


def test_a_failure_with_every_open_row_blocked_ends_the_wait_with_the_reasons() -> None:
    conn = _Conn([[("returned", 1, 1), ("pending", 4, 0), ("confirmed", 5, 5)]], blocked=4)
    delivery, clock = wait(conn)
    assert clock.pauses == [] and delivery.blocked == 4 and delivery.returned == 1
    assert conn.sent == ["poll", "blocked", "reasons"]
    assert delivery.reasons == (Reason("returned", "312 NO_ROUTE", 1, "m0"),)
