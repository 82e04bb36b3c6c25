"""``wait="confirmed"``'s decisions, without Spark or a database: when a batch's rows are settled,
when to look for rows blocked behind a failed row of their key, how long to pause between
polls, what the summary and the error say, and the options as untrusted input."""

from __future__ import annotations

import math

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
