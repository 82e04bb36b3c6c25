"""The consumer kit's pure parts: a window handed to a handler thread (taken, cut, abandoned) and
the database outage's backoff."""

from __future__ import annotations

import random

from app.consumer.inbox import Message
from app.consumer.kit import Outage
from app.consumer.work import Held, Window


def helds(n: int) -> list[Held]:
    return [
        Held(tag=i + 1, message=Message(message_id=f"m{i}", body=b"", routing_key="", exchange=""))
        for i in range(n)
    ]


def test_a_cut_window_gives_up_what_it_has_not_started() -> None:
    clock = iter(range(100)).__next__
    window = Window(helds(5), clock=lambda: float(clock()))
    first = window.take()
    assert first is not None and window.running is not None and window.running[0] is first
    rest = window.cut()
    assert [h.tag for h in rest] == [2, 3, 4, 5]
    assert window.take() is None and window.running is None  # the job takes no more
    assert [h.tag for h in window.items] == [1] and window.untaken() == []


def test_an_abandoned_window_cannot_commit_and_a_committing_one_cannot_be_abandoned() -> None:
    window = Window(helds(2))
    assert window.take() is not None
    assert window.abandon() is True
    assert window.take() is None
    assert window.begin_commit() is False
    committing = Window(helds(1))
    committing.take()
    assert committing.begin_commit() is True
    assert committing.abandon() is False  # it commits: its outcome will be known
    committing.cancel_statement()  # no connection: nothing to cancel, no error


def test_an_outage_starts_once_backs_off_with_jitter_and_ends_with_its_length() -> None:
    outage = Outage(name="c", max_delay=1.0, rng=random.Random(7))
    assert outage.failed(OSError("refused"), 10.0) is True
    first = outage.next_try - 10.0
    assert 0.1 <= first <= 0.2
    assert outage.failed(OSError("refused"), 10.2) is False  # the same outage
    waits = []
    for i in range(8):
        outage.failed(OSError("refused"), 11.0 + i)
        waits.append(outage.next_try - (11.0 + i))
    assert max(waits) <= 1.0 and waits[-1] >= 0.5  # capped at max_delay, jittered by half
    assert outage.down and outage.recovered(25.0) == 15.0
    assert not outage.down and outage.recovered(26.0) is None
