"""The consumer's ack rule: ``multiple`` only over finished deliveries, every tag settled once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.consumer.acks import AckTracker


def test_multiple_only_over_a_contiguous_finished_run() -> None:
    t = AckTracker()
    for tag in (1, 2, 3, 4, 5):
        t.received(tag)
    t.finished(2)
    t.finished(3)
    assert t.ackable() is None  # 1 still running: acking 3 with multiple would ack 1 too
    t.finished(1)
    assert t.ackable() == (3, 3)
    t.settled(4)  # nacked on its own
    t.finished(5)
    assert t.ackable() == (5, 1)
    assert len(t) == 0


@given(st.permutations(list(range(1, 30))), st.sets(st.integers(1, 29)))
def test_every_finished_tag_is_acked_once_and_nothing_unfinished(
    order: list[int], nacked: set[int]
) -> None:
    t = AckTracker()
    for tag in range(1, 30):
        t.received(tag)
    acked: list[int] = []
    done: set[int] = set()
    low = 0
    for tag in order:  # handlers finish in any order
        if tag in nacked:
            t.settled(tag)
        else:
            t.finished(tag)
        done.add(tag)
        got = t.ackable()
        if got is not None:
            upto, _ = got
            assert all(x in done for x in range(low + 1, upto + 1))  # nothing unfinished acked
            acked += [x for x in range(low + 1, upto + 1) if x not in nacked]
            low = upto
    assert sorted(acked) == sorted(set(range(1, 30)) - nacked)
