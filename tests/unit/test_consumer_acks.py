"""The consumer's ack rule: every finished delivery acked at once (no head-of-line blocking),
``multiple`` only over the finished run at the head, every tag settled exactly once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.consumer.acks import Ack, AckTracker


def test_multiple_over_the_finished_head_and_single_acks_behind_a_running_delivery() -> None:
    t = AckTracker()
    for tag in (1, 2, 3, 4, 5):
        t.received(tag)
    t.finished(2)
    t.finished(3)
    # 1 still runs: acking 3 with multiple would ack 1 too, so 2 and 3 go one by one
    assert t.acks() == [Ack(2, False, 1), Ack(3, False, 1)]
    t.finished(1)
    assert t.acks() == [Ack(1, False, 1)]
    t.settled(4)  # nacked on its own
    t.finished(5)
    assert t.acks() == [Ack(5, False, 1)]
    assert len(t) == 0


def test_a_finished_head_run_is_one_frame() -> None:
    t = AckTracker()
    for tag in range(1, 8):
        t.received(tag)
    for tag in (1, 2, 3, 5, 6):
        t.finished(tag)
    assert t.acks() == [Ack(3, True, 3), Ack(5, False, 1), Ack(6, False, 1)]
    assert t.acks(multiple=True) == []
    t.finished(4)
    t.finished(7)
    assert t.acks(multiple=False) == [Ack(4, False, 1), Ack(7, False, 1)]


@given(st.permutations(list(range(1, 30))), st.sets(st.integers(1, 29)), st.booleans())
def test_every_finished_tag_is_acked_once_and_nothing_unfinished(
    order: list[int], nacked: set[int], multiple: bool
) -> None:
    t = AckTracker()
    for tag in range(1, 30):
        t.received(tag)
    acked: list[int] = []
    settled: set[int] = set()  # acked, nacked or rejected: the broker forgot them
    done: set[int] = set()
    for tag in order:  # handlers finish in any order
        if tag in nacked:
            t.settled(tag)
            settled.add(tag)
        else:
            t.finished(tag)
        done.add(tag)
        for frame in t.acks(multiple=multiple):
            if frame.multiple:
                covered = [x for x in range(1, frame.tag + 1) if x not in settled]
                assert all(x in done for x in covered)  # nothing unfinished acked
                assert len(covered) == frame.count
            else:
                covered = [frame.tag]
                assert frame.tag in done and frame.tag not in settled
            acked += covered
            settled |= set(covered)
    assert sorted(acked) == sorted(set(range(1, 30)) - nacked)
