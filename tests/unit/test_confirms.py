"""The sans-IO confirm ledger: feed it publishes and broker frames, assert on the events."""

from __future__ import annotations

import copy
import datetime as dt
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.confirms import (
    ChannelLedger,
    Confirmed,
    Event,
    LedgerError,
    LocalProtocolError,
    Lost,
    Nacked,
    RemoteProtocolError,
    Returned,
    UnknownDeliveryTag,
    UnknownReturn,
)

NO_ROUTE = (312, "NO_ROUTE")


def row(tag: int) -> int:
    """Row ids differ from tags so a mix-up shows."""
    return 1000 + tag


def mid(tag: int) -> str:
    return f"msg-{tag}"


def ledger_with(n: int, *, channel_id: int = 1) -> ChannelLedger:
    ledger = ChannelLedger(channel_id=channel_id)
    assert ledger.published_many([(row(t), mid(t)) for t in range(1, n + 1)]) == range(1, n + 1)
    return ledger


def ret(ledger: ChannelLedger, tag: int) -> list[Event]:
    return ledger.returned(message_id=mid(tag), reply_code=NO_ROUTE[0], reply_text=NO_ROUTE[1])


def returned_event(tag: int) -> Returned:
    return Returned(row_id=row(tag), message_id=mid(tag), reply_code=312, reply_text="NO_ROUTE")


def state(ledger: ChannelLedger) -> dict[str, Any]:
    """Every slot but the error counter, dicts as ordered item lists."""
    out: dict[str, Any] = {}
    for name in ChannelLedger.__slots__:
        value = copy.copy(getattr(ledger, name))
        out[name] = list(value.items()) if isinstance(value, dict) else value
    del out["_protocol_errors"]
    return out


def rows(*tags: int) -> tuple[int, ...]:
    return tuple(row(t) for t in tags)


def confirmed_ids(events: list[Event]) -> list[int]:
    return [i for e in events if isinstance(e, Confirmed) for i in e.row_ids]


# ---------------------------------------------------------------- publishing


def test_tags_count_from_one_per_channel() -> None:
    ledger = ChannelLedger(channel_id=7)
    assert (ledger.channel_id, ledger.next_tag, ledger.outstanding) == (7, 1, 0)
    assert ledger.published(row_id=row(1), message_id=mid(1)) == 1
    assert ledger.published_many([(row(2), mid(2)), (row(3), mid(3))]) == range(2, 4)
    assert ledger.published_many([]) == range(4, 4)
    assert (ledger.next_tag, ledger.outstanding) == (4, 3)
    assert [ledger.row_for_tag(t) for t in (0, 1, 3, 4)] == [None, row(1), row(3), None]


def test_duplicate_message_id_in_flight_is_local_error() -> None:
    ledger = ledger_with(2)
    before = state(ledger)
    with pytest.raises(LocalProtocolError):
        ledger.published(row_id=99, message_id=mid(2))
    with pytest.raises(LocalProtocolError):
        ledger.published_many([(98, "fresh"), (99, mid(1))])
    with pytest.raises(LocalProtocolError):
        ledger.published_many([(98, "twice"), (99, "twice")])
    assert state(ledger) == before
    assert ledger.protocol_errors == 0


def test_message_id_reusable_after_settle() -> None:
    ledger = ledger_with(1)
    ledger.ack(1)
    assert ledger.published(row_id=row(1), message_id=mid(1)) == 2
    assert ledger.ack(2) == [Confirmed(row_ids=rows(1))]


def test_publish_after_channel_lost_is_local_error() -> None:
    ledger = ledger_with(1)
    ledger.channel_lost(reason="404")
    assert ledger.closed
    with pytest.raises(LocalProtocolError):
        ledger.published(row_id=5, message_id="new")
    with pytest.raises(LocalProtocolError):
        ledger.published_many([(5, "new")])


# ---------------------------------------------------------------- acks and nacks


def test_aiormq_regression_acks_1_2_4_then_5_multiple() -> None:
    ledger = ledger_with(5)
    events = ledger.ack(1) + ledger.ack(2) + ledger.ack(4) + ledger.ack(5, multiple=True)
    assert events == [
        Confirmed(row_ids=rows(1)),
        Confirmed(row_ids=rows(2)),
        Confirmed(row_ids=rows(4)),
        Confirmed(row_ids=rows(3, 5)),
    ]
    assert ledger.outstanding == 0
    assert ledger.protocol_errors == 0


def test_out_of_order_single_acks() -> None:
    ledger = ledger_with(3)
    assert ledger.ack(3) == [Confirmed(row_ids=rows(3))]
    assert ledger.oldest_outstanding_at() == 0.0
    assert ledger.ack(1) == [Confirmed(row_ids=rows(1))]
    assert ledger.ack(2) == [Confirmed(row_ids=rows(2))]
    assert ledger.outstanding == 0
    assert ledger.oldest_outstanding_at() is None


def test_multiple_ack_covers_a_gap() -> None:
    ledger = ledger_with(6)
    ledger.ack(2)
    ledger.ack(4)
    assert ledger.ack(5, multiple=True) == [Confirmed(row_ids=rows(1, 3, 5))]
    assert ledger.outstanding == 1
    assert ledger.row_for_tag(6) == row(6)


def test_multiple_ack_may_name_a_settled_tag_above_outstanding_ones() -> None:
    ledger = ledger_with(3)
    ledger.ack(3)
    assert ledger.ack(3, multiple=True) == [Confirmed(row_ids=rows(1, 2))]


def test_nack_single_and_multiple() -> None:
    ledger = ledger_with(4)
    assert ledger.nack(2) == [Nacked(row_ids=rows(2))]
    assert ledger.nack(3, multiple=True) == [Nacked(row_ids=rows(1, 3))]
    assert ledger.ack(4) == [Confirmed(row_ids=rows(4))]


def test_return_then_ack_is_returned_not_confirmed() -> None:
    ledger = ledger_with(3)
    assert ret(ledger, 2) == []
    assert ledger.outstanding == 3
    assert ledger.ack(3, multiple=True) == [Confirmed(row_ids=rows(1, 3)), returned_event(2)]


def test_return_then_single_ack() -> None:
    ledger = ledger_with(1)
    ret(ledger, 1)
    assert ledger.ack(1) == [returned_event(1)]


def test_return_then_nack_is_returned() -> None:
    ledger = ledger_with(2)
    ret(ledger, 1)
    ret(ledger, 2)
    assert ledger.nack(1) == [returned_event(1)]
    assert ledger.nack(2, multiple=True) == [returned_event(2)]


def test_channel_lost_with_some_returned() -> None:
    ledger = ledger_with(4, channel_id=3)
    ledger.ack(1)
    ret(ledger, 3)
    events = ledger.channel_lost(reason="channel 3 closed: 404 NOT_FOUND")
    assert events == [
        Lost(row_ids=rows(2, 4), reason="channel 3 closed: 404 NOT_FOUND"),
        returned_event(3),
    ]
    assert (ledger.outstanding, ledger.closed, ledger.oldest_outstanding_at()) == (0, True, None)
    assert ledger.channel_lost(reason="again") == []


def test_channel_lost_with_nothing_outstanding() -> None:
    ledger = ledger_with(1)
    ledger.ack(1)
    assert ledger.channel_lost(reason="closed") == []


def test_tag_zero_multiple_acks_every_outstanding_tag() -> None:
    """AMQP 0-9-1 basic.ack: "If the multiple field is 1, and the delivery tag is zero, this
    indicates acknowledgement of all outstanding messages"; a returned one settles as Returned."""
    ledger = ledger_with(6)
    ledger.ack(2)
    ledger.nack(5)
    ret(ledger, 4)
    assert ledger.ack(0, multiple=True) == [Confirmed(row_ids=rows(1, 3, 6)), returned_event(4)]
    assert (ledger.outstanding, ledger.oldest_outstanding_at(), ledger.protocol_errors) == (
        0,
        None,
        0,
    )
    assert ledger.published(row_id=row(7), message_id=mid(7)) == 7
    assert ledger.ack(7) == [Confirmed(row_ids=rows(7))]


def test_tag_zero_multiple_nacks_every_outstanding_tag() -> None:
    ledger = ledger_with(4)
    ledger.ack(3)
    assert ledger.nack(0, multiple=True) == [Nacked(row_ids=rows(1, 2, 4))]
    assert (ledger.outstanding, ledger.protocol_errors) == (0, 0)


@pytest.mark.parametrize("nack", [False, True], ids=["ack", "nack"])
def test_tag_zero_multiple_with_nothing_outstanding_settles_nothing(nack: bool) -> None:
    """All outstanding of none is no publish, and no error: before any publish, after every
    one settled, and after the channel was lost."""
    fresh, settled, lost = ChannelLedger(channel_id=1), ledger_with(2), ledger_with(2)
    settled.ack(2, multiple=True)
    lost.channel_lost(reason="gone")
    for ledger in (fresh, settled, lost):
        before = state(ledger)
        assert (ledger.nack if nack else ledger.ack)(0, multiple=True) == []
        assert (state(ledger), ledger.protocol_errors) == (before, 0)


def test_ack_after_channel_lost_is_unknown_tag() -> None:
    ledger = ledger_with(2)
    ledger.channel_lost(reason="gone")
    with pytest.raises(UnknownDeliveryTag):
        ledger.ack(1)
    with pytest.raises(UnknownDeliveryTag):
        ledger.nack(2, multiple=True)


# ---------------------------------------------------------------- impossible broker frames

ILLEGAL = [
    pytest.param(lambda lg: lg.ack(99), id="unknown-tag"),
    pytest.param(lambda lg: lg.ack(0), id="tag-zero"),
    pytest.param(lambda lg: lg.nack(0), id="nack-tag-zero"),
    pytest.param(lambda lg: lg.ack(2), id="double-ack"),
    pytest.param(lambda lg: lg.nack(2), id="nack-after-ack"),
    pytest.param(lambda lg: lg.ack(2, multiple=True), id="multiple-nothing-below"),
    pytest.param(lambda lg: lg.nack(6, multiple=True), id="multiple-beyond-last"),
    pytest.param(lambda lg: lg.ack(6), id="single-beyond-last"),
]


@pytest.mark.parametrize("frame", ILLEGAL)
def test_impossible_frame_raises_counts_and_changes_nothing(frame: Any) -> None:
    ledger = ledger_with(5)
    ledger.ack(2, multiple=True)  # tags 1, 2 settled; 3, 4, 5 outstanding
    ret(ledger, 4)
    ledger.oldest_outstanding_at()
    before = state(ledger)
    with pytest.raises(UnknownDeliveryTag) as caught:
        frame(ledger)
    assert isinstance(caught.value, RemoteProtocolError)
    assert isinstance(caught.value.tag, int)
    assert isinstance(caught.value.multiple, bool)
    assert state(ledger) == before
    assert ledger.protocol_errors == 1
    assert ledger.ack(5, multiple=True) == [Confirmed(row_ids=rows(3, 5)), returned_event(4)]


def test_unknown_delivery_tag_carries_tag_and_multiple() -> None:
    ledger = ledger_with(1)
    with pytest.raises(UnknownDeliveryTag) as caught:
        ledger.nack(7, multiple=True)
    assert (caught.value.tag, caught.value.multiple, caught.value.channel_id) == (7, True, 1)


@pytest.mark.parametrize("message_id", ["never-published", mid(1)], ids=["unknown", "settled"])
def test_return_of_unknown_message_id(message_id: str) -> None:
    ledger = ledger_with(2)
    ledger.ack(1)
    before = state(ledger)
    with pytest.raises(UnknownReturn) as caught:
        ledger.returned(message_id=message_id, reply_code=312, reply_text="NO_ROUTE")
    assert caught.value.message_id == message_id
    assert state(ledger) == before
    assert ledger.protocol_errors == 1


def test_second_return_of_same_publish_is_remote_error() -> None:
    ledger = ledger_with(1)
    ret(ledger, 1)
    before = state(ledger)
    with pytest.raises(UnknownReturn):
        ret(ledger, 1)
    assert state(ledger) == before
    assert ledger.ack(1) == [returned_event(1)]


def test_error_hierarchy() -> None:
    assert issubclass(LocalProtocolError, LedgerError)
    assert issubclass(RemoteProtocolError, LedgerError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert issubclass(UnknownReturn, RemoteProtocolError)


# ---------------------------------------------------------------- confirm timeout input


def test_oldest_outstanding_at_follows_the_lowest_outstanding_tag() -> None:
    ledger = ChannelLedger(channel_id=1)
    ledger.published_many([(row(1), mid(1)), (row(2), mid(2))], at=10.0)
    ledger.published(row_id=row(3), message_id=mid(3), at=11.0)
    ledger.published(row_id=row(4), message_id=mid(4), at=12.0)
    assert ledger.oldest_outstanding_at() == 10.0
    ledger.ack(1)
    assert ledger.oldest_outstanding_at() == 10.0
    ledger.ack(3)
    ledger.ack(2)
    assert ledger.oldest_outstanding_at() == 12.0
    ledger.ack(4)
    assert ledger.oldest_outstanding_at() is None
    ledger.published(row_id=row(5), message_id=mid(5), at=13.0)
    assert ledger.oldest_outstanding_at() == 13.0


# ---------------------------------------------------------------- long runs


def test_200k_publishes_settle_in_linear_time() -> None:
    """200k one-row publish batches all in flight, then mixed single and multiple acks.

    Bookkeeping that costs O(in flight) per publish batch or per ack would run for minutes.
    """
    ledger = ChannelLedger(channel_id=1)
    n, block = 200_000, 10
    for tag in range(1, n + 1):  # one-row batches: the worst case for per-batch overhead
        ledger.published_many([(tag, mid(tag))], at=float(tag // 4))
    assert (ledger.next_tag, ledger.oldest_outstanding_at()) == (n + 1, 0.0)
    confirmed: list[int] = []
    for start in range(1, n + 1, block):
        end = start + block - 1
        for tag in range(end - 1, start, -3):  # singles, high to low, leave gaps
            confirmed += confirmed_ids(ledger.ack(tag))
            ledger.oldest_outstanding_at()
        confirmed += confirmed_ids(ledger.ack(end, multiple=True))
    assert len(confirmed) == n
    assert set(confirmed) == set(range(1, n + 1))
    assert (ledger.outstanding, ledger.protocol_errors) == (0, 0)


def test_long_gap_at_the_front_then_one_ack() -> None:
    ledger = ledger_with(200_000)
    for tag in range(2, 200_001):
        ledger.ack(tag)
    assert ledger.oldest_outstanding_at() == 0.0
    assert ledger.ack(1) == [Confirmed(row_ids=rows(1))]
    assert ledger.outstanding == 0


# ---------------------------------------------------------------- properties


class Model:
    """Drives a ledger with a random legal broker schedule and checks every event it returns."""

    def __init__(self, data: st.DataObject, n: int) -> None:
        self.data = data
        self.ledger = ledger_with(n)
        self.outstanding = set(range(1, n + 1))
        self.returned: set[int] = set()
        self.events: list[Event] = []

    def return_some(self, candidates: set[int]) -> None:
        for tag in sorted(candidates - self.returned):
            assert ret(self.ledger, tag) == []
            self.returned.add(tag)

    def frame(self, tag: int, to_return: set[int]) -> None:
        if tag == 0:  # with multiple: every outstanding tag, none when none is
            self.answer(0, True, set(self.outstanding), to_return)
            return
        below = {t for t in self.outstanding if t <= tag}
        if not below:
            return
        multiple = tag not in self.outstanding or self.data.draw(st.booleans(), label="multiple")
        self.answer(tag, multiple, below if multiple else {tag}, to_return)

    def answer(self, tag: int, multiple: bool, settled: set[int], to_return: set[int]) -> None:
        self.return_some(settled & to_return)  # the broker sends basic.return before the ack
        nack = self.data.draw(st.booleans(), label="nack")
        events = (self.ledger.nack if nack else self.ledger.ack)(tag, multiple=multiple)
        plain = tuple(row(t) for t in sorted(settled - self.returned))
        group: list[Event] = [(Nacked if nack else Confirmed)(row_ids=plain)] if plain else []
        assert events == group + [returned_event(t) for t in sorted(settled & self.returned)]
        self.outstanding -= settled
        self.events += events

    def lose(self) -> None:
        events = self.ledger.channel_lost(reason="lost")
        lost = tuple(row(t) for t in sorted(self.outstanding - self.returned))
        head: list[Event] = [Lost(row_ids=lost, reason="lost")] if lost else []
        assert events == head + [
            returned_event(t) for t in sorted(self.outstanding & self.returned)
        ]
        self.outstanding.clear()
        self.events += events

    def check_each_row_settled_once(self, n: int) -> None:
        seen: Counter[int] = Counter()
        for event in self.events:
            ids = (event.row_id,) if isinstance(event, Returned) else event.row_ids
            seen.update(ids)
            if isinstance(event, Confirmed):
                assert not {row(t) for t in self.returned} & set(ids)
        assert seen == Counter(row(t) for t in range(1, n + 1))
        assert (self.ledger.outstanding, self.ledger.oldest_outstanding_at()) == (0, None)


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, set[int], list[int], int | None]:
    n = draw(st.integers(min_value=1, max_value=40))
    to_return = draw(st.sets(st.integers(min_value=1, max_value=n)))
    order = list(draw(st.permutations(range(1, n + 1))))
    for at in draw(st.lists(st.integers(min_value=0, max_value=n), max_size=2)):
        order.insert(at, 0)  # tag 0, multiple: "all outstanding" (AMQP 0-9-1)
    lose_at = draw(st.none() | st.integers(min_value=0, max_value=n))
    return n, to_return, order, lose_at


def run_schedule(model: Model, plan: tuple[int, set[int], list[int], int | None]) -> None:
    n, to_return, order, lose_at = plan
    early = model.data.draw(
        st.sets(st.sampled_from(sorted(to_return))) if to_return else st.just(set())
    )
    model.return_some(early)
    for step, tag in enumerate(order):
        if step == lose_at:
            model.lose()
            break
        model.frame(tag, to_return)
    else:
        if lose_at is not None:
            model.lose()
    model.check_each_row_settled_once(n)


@settings(max_examples=200, deadline=None)
@given(plan=schedules(), data=st.data())
def test_any_legal_schedule_settles_every_row_exactly_once(
    plan: tuple[int, set[int], list[int], int | None], data: st.DataObject
) -> None:
    model = Model(data, plan[0])
    run_schedule(model, plan)
    assert model.ledger.protocol_errors == 0


@settings(max_examples=200, deadline=None)
@given(plan=schedules(), data=st.data())
def test_an_impossible_frame_is_refused_and_the_schedule_still_settles(
    plan: tuple[int, set[int], list[int], int | None], data: st.DataObject
) -> None:
    n, to_return, order, _ = plan
    model = Model(data, n)
    split = data.draw(st.integers(min_value=1, max_value=n), label="settle first")
    for tag in order[:split]:
        model.frame(tag, to_return)
    settled = sorted(set(range(1, n + 1)) - model.outstanding)
    bad_tag = data.draw(st.sampled_from(settled), label="bad tag")
    multiple = not any(t <= bad_tag for t in model.outstanding) and data.draw(st.booleans())
    nack = data.draw(st.booleans(), label="bad nack")
    before = state(model.ledger)
    with pytest.raises(UnknownDeliveryTag):
        (model.ledger.nack if nack else model.ledger.ack)(bad_tag, multiple=multiple)
    assert state(model.ledger) == before
    assert model.ledger.protocol_errors == 1
    for tag in order[split:]:
        model.frame(tag, to_return)
    model.check_each_row_settled_once(n)


# ---------------------------------------------------------------- the record of a publish


def test_settled_rows_carry_where_and_when_they_went_out() -> None:
    ledger = ChannelLedger(channel_id=3)
    t0, t1 = dt.datetime(2026, 1, 1, 12), dt.datetime(2026, 1, 1, 12, 0, 1)
    ledger.published_many([(row(1), mid(1)), (row(2), mid(2))], at=10.0, wall=t0)
    ledger.published(row_id=row(3), message_id=mid(3), at=11.0, wall=t1)
    ret(ledger, 2)
    (confirmed, returned) = ledger.ack(3, multiple=True)
    assert isinstance(confirmed, Confirmed) and isinstance(returned, Returned)
    assert confirmed.row_ids == (row(1), row(3))
    assert confirmed.sent == ((3, 1, t0, 10.0), (3, 3, t1, 11.0))
    assert returned.sent == (3, 2, t0, 10.0)


def test_due_notes_report_each_unconfirmed_publish_once_after_its_deadline() -> None:
    ledger = ChannelLedger(channel_id=1)
    t0, t1 = dt.datetime(2026, 1, 1, 12), dt.datetime(2026, 1, 1, 12, 0, 5)
    ledger.published_many([(row(t), mid(t)) for t in (1, 2, 3)], at=10.0, wall=t0)
    ledger.published_many([(row(t), mid(t)) for t in (4, 5)], at=15.0, wall=t1)
    ledger.ack(2)
    notes: dict[Any, list[tuple[int, int]]] = {}
    assert ledger.next_note_at() == 10.0
    assert ledger.due_notes(9.9, notes) == 0 and notes == {}  # nothing written that early
    assert ledger.due_notes(12.0, notes) == 2
    assert notes == {(1, t0): [(row(1), 1), (row(3), 3)]}  # tag 2 was acked: no note
    assert ledger.next_note_at() == 15.0
    assert ledger.due_notes(12.0, notes) == 0  # reported once
    ledger.ack(5)
    assert ledger.due_notes(100.0, notes) == 1
    assert notes[(1, t1)] == [(row(4), 4)]
    assert ledger.next_note_at() is None and ledger.due_notes(200.0, notes) == 0
    ledger.published(row_id=row(6), message_id=mid(6), at=300.0, wall=t1)
    ledger.channel_lost(reason="gone")
    assert ledger.next_note_at() is None and ledger.due_notes(400.0, notes) == 0
