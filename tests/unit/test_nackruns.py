"""The verdict on nacks (pure): the rows' fault among acks, or a destination outage, judged on
time (no ack of the exchange for ``outage_after``), never on the size of one frame."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.publisher.nackruns import NackRuns


def test_an_ack_to_the_same_exchange_charges_the_run_to_its_rows() -> None:
    runs = NackRuns(burst=3)
    assert runs.nacked("ex", [1, 2], now=0.0) == []
    assert runs.acked("other", now=0.1) == []  # another exchange's ack says nothing of this one
    assert runs.acked("ex", now=0.2) == [1, 2]
    assert not runs and runs.waiting() == 0


def test_a_burst_in_one_frame_is_no_verdict_by_itself() -> None:
    """Issue 44: 50 rows answered by one multiple nack were judged an outage at the frame."""
    runs = NackRuns(burst=3, outage_after=1.0)
    assert runs.nacked("ex", list(range(50)), now=0.0) == []
    assert not runs.due(0.5)
    assert runs.acked("ex", now=0.6) == list(range(50))  # the exchange takes other rows


def test_nacks_right_after_an_ack_are_charged_at_once() -> None:
    runs = NackRuns(burst=3, outage_after=1.0)
    runs.acked("ex", now=10.0)
    assert runs.nacked("ex", [1, 2, 3, 4], now=10.5) == [1, 2, 3, 4]
    assert not runs
    assert runs.nacked("ex", [5, 6, 7], now=11.5) == []  # a second since the ack: it waits


def test_a_burst_with_no_ack_for_a_while_is_an_outage() -> None:
    runs = NackRuns(burst=3, outage_after=1.0)
    runs.nacked("ex", [1], now=0.0)
    runs.nacked("b", [9], now=0.5)
    runs.nacked("ex", [2, 3], now=0.1)
    assert runs.next_due() == 1.0
    verdict = runs.due(1.0)
    assert verdict.outage == {"ex": [1, 2, 3]} and verdict.charged == []
    assert runs.waiting() == 1  # b's run stays open
    assert runs.due(1.5).charged == [9]  # one nack, no other traffic: charged


def test_stop_releases_the_rows_waiting_for_a_verdict() -> None:
    runs = NackRuns(burst=5)
    runs.nacked("ex", [1, 2], now=0.0)
    assert runs.release_all() == [1, 2]
    assert not runs


def test_dropped_rows_leave_their_run() -> None:
    runs = NackRuns(burst=5)
    runs.nacked("ex", [1, 2], now=0.0)
    runs.drop({1, 2})
    assert not runs


_events = st.lists(
    st.tuples(
        st.sampled_from(["nack", "ack", "tick"]),
        st.sampled_from(["a", "b"]),
        st.integers(1, 30),  # rows in a nack frame
        st.floats(0.0, 0.7),  # time since the previous event
    ),
    max_size=40,
)


@given(_events)
def test_every_nacked_row_gets_one_verdict_and_an_outage_only_without_acks(events: list) -> None:  # type: ignore[type-arg]
    """Over any interleaving: each nacked row is charged or put in an outage exactly once
    (none lost, none twice), never before its verdict is due, and an exchange is judged out only
    when it acked nothing for ``outage_after`` before the verdict."""
    runs = NackRuns(burst=3, outage_after=1.0)
    now, next_id = 0.0, 0
    judged: dict[int, str] = {}
    nacked_at: dict[int, float] = {}
    acks: dict[str, list[float]] = {"a": [], "b": []}

    def record(ids: list[int], how: str) -> None:
        for i in ids:
            assert i not in judged, f"row {i} judged twice"
            judged[i] = how

    for kind, exchange, n, step in events:
        now += step
        verdict = runs.due(now)
        record(verdict.charged, "charged")
        for x, ids in verdict.outage.items():
            assert len(ids) >= 3
            assert not any(now - 1.0 < t <= now for t in acks[x]), "out while it acked"
            assert all(now - nacked_at[i] >= 1.0 - 1e-9 for i in ids[:1]), "judged early"
            record(ids, "outage")
        if kind == "nack":
            ids = list(range(next_id, next_id + n))
            next_id += n
            for i in ids:
                nacked_at[i] = now
            record(runs.nacked(exchange, ids, now), "charged")
        elif kind == "ack":
            acks[exchange].append(now)
            record(runs.acked(exchange, now), "charged")
    last = runs.due(now + 10.0)
    record(last.charged, "charged")
    record([i for ids in last.outage.values() for i in ids], "outage")
    assert runs.waiting() == 0
    assert set(judged) == set(range(next_id)), "a nacked row got no verdict"
