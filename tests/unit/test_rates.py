"""The overview's chart geometry and its trend in words (``app.rates``): pure, no services."""

from __future__ import annotations

import pytest

from app.rates import (
    RECENT_MINUTES,
    chart,
    latency_chart,
    nice_peak,
    rate_words,
    recent_rate,
    trend,
)

QUIET = [0] * 60


def minutes(*tail: int) -> list[int]:
    """An hour of per-minute counts ending with ``tail``."""
    return [0] * (60 - len(tail)) + list(tail)


@pytest.mark.parametrize(
    ("value", "peak"), [(0, 1), (1, 1), (2, 2), (3, 5), (7, 10), (10, 10), (11, 20), (1201, 2000)]
)
def test_the_scale_tops_at_1_2_or_5_times_a_power_of_ten(value: int, peak: int) -> None:
    assert nice_peak(value) == peak


def test_rates_read_the_last_five_minutes_and_print_for_people() -> None:
    assert recent_rate(minutes(100, 0, 0, 0, 0, 0)) == 0.0
    assert recent_rate(minutes(1000, 1200, 1400, 1000, 1400)) == 1200.0
    assert (rate_words(1200.0), rate_words(2.4), rate_words(0.0)) == (
        "1,200/min",
        "2.4/min",
        "0/min",
    )


def test_the_chart_puts_every_series_on_one_scale_left_to_right() -> None:
    c = chart([("written", minutes(50)), ("confirmed", minutes(100))])
    assert c.peak == 100 and c.minutes == 60
    written, confirmed = (line.points.split() for line in c.lines)
    assert len(written) == 60
    assert written[0] == f"{c.left:.1f},{c.bottom:.1f}"  # zero at the axis, first minute left
    assert confirmed[-1] == f"{c.right:.1f},{c.top:.1f}"  # the peak at the top, last minute right
    middle = (c.bottom + c.top) / 2
    assert written[-1] == f"{c.right:.1f},{middle:.1f}"


def test_an_empty_outbox_is_idle() -> None:
    t = trend(backlog=0, written=QUIET, confirmed=QUIET, failed=QUIET)
    assert t.state == "idle"
    assert t.words == f"Idle: nothing waiting, nothing written in the last {RECENT_MINUTES} min."


def test_draining_says_how_fast_and_when_the_backlog_is_empty() -> None:
    t = trend(
        backlog=24_000,
        written=minutes(*[400] * 5),
        confirmed=minutes(*[1200] * 5),
        failed=QUIET,
    )
    assert t.state == "draining"
    assert t.words == (
        "Draining: confirming 1,200/min, writing 400/min; backlog falling "
        "(24,000 rows waiting, empty in about 30 min)."
    )


def test_nothing_confirmed_lately_with_rows_waiting_is_stuck_whatever_came_before() -> None:
    busy_then_silent = [1000] * 55 + [0] * 5
    t = trend(backlog=5, written=QUIET, confirmed=busy_then_silent, failed=QUIET)
    assert t.state == "stuck"
    assert t.words == (
        f"Stuck: 5 rows waiting and nothing confirmed or failed in the last {RECENT_MINUTES} min."
    )
    blind = trend(backlog=1, written=QUIET, confirmed=QUIET, failed=QUIET, sampled=False)
    assert blind.words.endswith("No publisher recorded its figures in the last hour.")


def test_confirming_slower_than_writing_is_falling_behind_and_failures_count_as_leaving() -> None:
    behind = trend(
        backlog=900, written=minutes(*[300] * 5), confirmed=minutes(*[100] * 5), failed=QUIET
    )
    assert behind.state == "behind"
    assert behind.words == (
        "Falling behind: confirming 100/min, writing 300/min; backlog growing (900 rows waiting)."
    )
    flat = trend(
        backlog=10,
        written=minutes(*[300] * 5),
        confirmed=minutes(*[200] * 5),
        failed=minutes(*[100] * 5),
    )
    assert flat.state == "holding" and "failing 100/min" in flat.words


def test_no_backlog_with_traffic_is_keeping_up() -> None:
    t = trend(backlog=0, written=minutes(*[60] * 5), confirmed=minutes(*[60] * 5), failed=QUIET)
    assert t.state == "keeping-up"
    assert t.words == "Keeping up: confirming 60/min, writing 60/min; nothing waiting."


def test_the_latency_chart_draws_only_the_minutes_that_had_confirms() -> None:
    p50 = [None] * 57 + [4.0, None, 6.0]
    p99 = [None] * 57 + [40.0, None, 120.0]
    chart = latency_chart([("p50", p50), ("p99", p99)])
    assert chart.peak == 200 and chart.minutes == 60
    assert [len(line.points.split()) for line in chart.lines] == [2, 2]
    assert [line.per_minute for line in chart.lines] == [6.0, 120.0]
    empty = latency_chart([("p50", [None] * 60), ("p99", [None] * 60)])
    assert empty.peak == 1 and all(line.points == "" for line in empty.lines)
