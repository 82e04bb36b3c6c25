"""Settlement (pure): what each broker answer and each close means for the rows, and the
quarantine that finds the one row the broker refuses among a window of good ones."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from app.amqp.errors import CloseReason
from app.confirms import Confirmed, Lost, Nacked, Returned
from app.publisher.outcomes import Outcomes
from app.publisher.settlement import (
    PLAIN,
    POISON_STRIKES,
    CloseCause,
    CloseKind,
    Quarantine,
    classify_channel_close,
    classify_connection_loss,
    destination_reason,
    lose,
    settle,
)


@dataclass(frozen=True)
class Row:
    exchange: str = "ex"
    body: bytes = b"x"


# ---------------------------------------------------------------- close classification


def test_channel_closes_blame_an_exchange_a_size_or_the_outstanding_rows() -> None:
    c = classify_channel_close(CloseReason(404, "NOT_FOUND - no exchange 'orders.v2' in vhost '/'"))
    assert (c.kind, c.exchange) == (CloseKind.DESTINATION, "orders.v2")
    text = "ACCESS_REFUSED - access to exchange 'x' in vhost '/' refused for user 'u'"
    assert classify_channel_close(CloseReason(403, text)).exchange == "x"
    text = "PRECONDITION_FAILED - message size 200 is larger than configured max size 100"
    c = classify_channel_close(CloseReason(406, text))
    assert (c.kind, c.max_size) == (CloseKind.OVERSIZED, 100)
    for other in (
        (406, "PRECONDITION_FAILED - other"),
        (404, "NOT_FOUND - no queue 'q'"),
        (504, "CHANNEL_ERROR"),
    ):
        assert classify_channel_close(CloseReason(*other)).kind is CloseKind.UNEXPLAINED
    assert classify_channel_close(CloseReason(200, "bye", by_peer=False)) is PLAIN


def test_only_frame_and_content_errors_blame_a_connections_publishes() -> None:
    assert classify_connection_loss(CloseReason(501, "FRAME_ERROR")).kind is CloseKind.UNEXPLAINED
    assert classify_connection_loss(CloseReason(505, "UNEXPECTED_FRAME")).kind is (
        CloseKind.UNEXPLAINED
    )
    assert classify_connection_loss(CloseReason(320, "CONNECTION_FORCED")) is PLAIN
    assert classify_connection_loss(CloseReason(320, "connection lost: reset")) is PLAIN
    assert classify_connection_loss(CloseReason(501, "missed", by_peer=False)) is PLAIN


# ---------------------------------------------------------------- answers and plain closes


def test_answers_become_outcomes() -> None:
    out, q = Outcomes(), Quarantine()
    tally = settle([Confirmed((1, 2)), Returned(3, "m3", 312, "NO_ROUTE"), Nacked((4,))], out, q)
    assert (out.confirmed, [r.id for r in out.returned], out.nacked) == ([1, 2], [3], [4])
    assert (tally.confirmed, tally.returned, tally.nacked) == (2, 1, 1)


def test_a_plain_loss_releases_as_possible_duplicates_and_keeps_returns() -> None:
    out = Outcomes()
    events = [Lost((1, 2), "connection lost"), Returned(3, "m3", 312, "NO_ROUTE")]
    tally = lose(events, out, cause=PLAIN, rows={}, quarantine=Quarantine())
    assert out.lost == {"connection lost": [1, 2]} and [r.id for r in out.returned] == [3]
    assert tally.lost == 2 and not out.failed and not out.resent


def test_a_missing_exchange_backs_off_its_rows_only() -> None:
    out = Outcomes()
    rows = {1: Row("gone"), 2: Row("ok"), 3: Row("gone")}
    cause = CloseCause(CloseKind.DESTINATION, exchange="gone")
    tally = lose([Lost((1, 2, 3), "404")], out, cause=cause, rows=rows, quarantine=Quarantine())
    assert out.destination == {"exchange 'gone': 404": [1, 3]} and out.lost == {"404": [2]}
    assert tally.paused == "gone"


def test_one_missing_exchange_is_one_reason_whichever_channel_or_path_saw_it() -> None:
    """`outbox failures` groups rows by reason: closes on two channels and the passive check
    (``destination_reason`` with the broker's words) must leave the same text on the rows."""
    words = "NOT_FOUND - no exchange 'gone' in vhost '/'"
    cause = classify_channel_close(CloseReason(404, words))
    out, q = Outcomes(), Quarantine()
    for channel, row in ((3, 1), (5, 2)):
        lost = Lost((row,), f"channel {channel} closed: 404 {words}")
        tally = lose([lost], out, cause=cause, rows={row: Row("gone")}, quarantine=q)
        assert tally.paused_reason == f"404 {words}"  # what the paused exchange's rows get
    checked = destination_reason("gone", str(CloseReason(404, words)))
    assert out.destination == {checked: [1, 2]}


def test_an_oversized_close_fails_the_big_bodies_only() -> None:
    out = Outcomes()
    rows = {1: Row(body=b"x" * 200), 2: Row(body=b"x" * 50)}
    cause = CloseCause(CloseKind.OVERSIZED, max_size=100)
    lose([Lost((1, 2), "406")], out, cause=cause, rows=rows, quarantine=Quarantine())
    assert list(out.failed.values()) == [[1]] and out.lost == {"406": [2]}


# ---------------------------------------------------------------- quarantine

UNEXPLAINED = CloseCause(CloseKind.UNEXPLAINED)


def run_quarantine(window: list[int], poison: set[int]) -> tuple[Outcomes, int]:
    """Play the broker: a publish of a poison row closes what it went out on, with every
    outstanding row; anything else is confirmed. Returns the outcomes and the closes seen."""
    out, q = Outcomes(), Quarantine()
    closes = 1
    lose(
        [Lost(tuple(window), "504 CHANNEL_ERROR")], out, cause=UNEXPLAINED, rows={}, quarantine=q
    )  # the first close, with the whole window outstanding
    while q:
        group = q.take()
        assert group is not None
        if poison & set(group):
            closes += 1
            lose(
                [Lost(tuple(group), "504 CHANNEL_ERROR")],
                out,
                cause=UNEXPLAINED,
                rows={},
                quarantine=q,
            )
        else:
            settle([Confirmed(tuple(group))], out, q)
    return out, closes


def test_one_poison_row_in_a_full_window_fails_alone_in_log2_closes() -> None:
    window = list(range(1, 10_001))
    out, closes = run_quarantine(window, {4242})
    assert [ids for ids in out.failed.values()] == [[4242]]
    assert "alone 3 times" in next(iter(out.failed))
    assert sorted(out.confirmed) == [i for i in window if i != 4242]
    assert closes <= math.ceil(math.log2(len(window))) + POISON_STRIKES


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 300).flatmap(
        lambda n: st.tuples(st.just(n), st.sets(st.integers(1, n), max_size=3))
    )
)
def test_the_quarantine_fails_exactly_the_poison_rows(case: tuple[int, set[int]]) -> None:
    n, poison = case
    window = list(range(1, n + 1))
    out, _ = run_quarantine(window, poison)
    failed = sorted(i for ids in out.failed.values() for i in ids)
    assert failed == sorted(poison)
    assert sorted(out.confirmed) == sorted(set(window) - poison)  # each settles exactly once


def test_an_isolated_group_lost_without_blame_goes_again_unstruck() -> None:
    out, q = Outcomes(), Quarantine()
    lose([Lost((7,), "504")], out, cause=UNEXPLAINED, rows={}, quarantine=q)
    assert q.strikes == {7: 1} and q.take() == [7]
    lose([Lost((7,), "connection lost")], out, cause=PLAIN, rows={}, quarantine=q)
    assert q.strikes == {7: 1} and q.groups[0] == [7] and not out.lost
    assert out.resent == {"suspect in an unexplained close: 504": [7], "connection lost": [7]}
