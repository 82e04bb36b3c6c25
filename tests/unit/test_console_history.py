"""A message's history in the console reads in the order its life happened, also when one
clock reading stamped several steps (a claim, its publish and the broker's answer)."""

from __future__ import annotations

import dataclasses
import datetime as dt

from app.api.console.messages import _history
from app.outbox.read.messages import MessageEvent, MessageRecord
from app.outbox.states import Status

T = dt.datetime(2026, 11, 27, 3, 0, tzinfo=dt.UTC)


def record(**values: object) -> MessageRecord:
    fields = {f.name: None for f in dataclasses.fields(MessageRecord)}
    fields.update(
        id=1,
        message_id="m-1",
        batch_id="b",
        exchange="orders",
        routing_key="eu",
        mandatory=True,
        status=Status.NACKED,
        attempts=2,
        max_attempts=2,
        nacks=2,
        lost_confirms=0,
        available_at=T,
        created_at=T,
        body_size=2,
    )
    fields.update(values)
    return MessageRecord(**fields)  # type: ignore[arg-type]


def event(kind: str, attempt: int, *, actor: str | None = None) -> MessageEvent:
    return MessageEvent(
        id=attempt,
        at=T,
        kind=kind,
        from_status=None,
        attempt=attempt,
        reply_code=None,
        detail="queue full",
        actor=actor,
        audit_id=None,
    )


def test_steps_stamped_at_one_instant_read_in_life_order() -> None:
    m = record(claimed_at=T, published_at=T, channel_id=1, delivery_tag=7)
    steps = [words for _at, words in _history(m, [event("nacked", 2), event("retry", 1)])]
    assert steps == [
        "written to the outbox",
        "attempt 1 failed: queue full; retried after a backoff",
        "claimed by a publisher (attempt 2 of 2)",
        "published to 'orders' on channel 1, delivery tag 7",
        "attempt 2 nacked by the broker (queue full): no attempts left",
    ]


def test_later_times_still_come_later_whatever_the_step() -> None:
    later = T + dt.timedelta(seconds=5)
    m = record(status=Status.CONFIRMED, attempts=1, claimed_at=later, confirmed_at=later)
    steps = _history(m, [event("retry", 1)])  # an attempt that failed before this claim
    assert [at for at, _ in steps] == [T, T, later, later]
    assert steps[-1][1] == "confirmed by the broker (ack)"
