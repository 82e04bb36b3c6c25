"""Schedules the generator found (or the trials before it), each kept as a named test.

Each is played exactly as the generated ones are (``test_confirm_core.play``) and checked by the
same model; the name says what broke.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.conformance.runner import play
from tests.conformance.schedules import (
    Answer,
    Block,
    CloseChannel,
    Cut,
    Junk,
    Pause,
    Return,
    RowSpec,
    Schedule,
    Undo,
)


def _rows(*specs: str, max_attempts: int = 2) -> tuple[RowSpec, ...]:
    """``"a/refused"`` ... -> row specs."""
    out = []
    for spec in specs:
        exchange, fate = spec.split("/")
        out.append(RowSpec(exchange, fate, max_attempts))  # type: ignore[arg-type]
    return tuple(out)


def _play(schedule: Schedule, template: Path, workdir: Path) -> None:
    asyncio.run(play(schedule, template, workdir))


def test_a_multiple_nack_among_acks_ends_nacked(template: Path, workdir: Path) -> None:
    """Issue 44: one ``basic.nack(multiple)`` of a burst of rows, on an exchange that acks its
    other rows, was judged a destination outage the moment the frame came; the rows went back
    without spending their budget, the acks ended the outage, and the rows looped for ever."""
    rows = _rows(*["a/normal"] * 2, *["a/refused"] * 5, *["a/normal"] * 2)
    _play(Schedule(rows, (), window=64, channels=1), template, workdir)


def test_an_exchange_that_refuses_everything_charges_after_the_bound(
    template: Path, workdir: Path
) -> None:
    """Every row of the exchange refused and no ack: a destination outage, waited out without
    spending the rows' budget for at most ``destination_outage_max_wait``, then charged."""
    rows = _rows(*["a/refused"] * 6)
    _play(Schedule(rows, (), window=64, channels=1), template, workdir)


def test_rows_parked_behind_a_lost_probe_still_end(template: Path, workdir: Path) -> None:
    """Found by the generator: nacks, then the connection cut around an outage's probe; three
    rows stayed ``in_flight``, held and never published again."""
    rows = (
        RowSpec("a", "normal", 3),
        RowSpec("b", "refused", 1),
        RowSpec("a", "unroutable", 1),
        RowSpec("a", "normal", 2),
        RowSpec("b", "normal", 3),
        RowSpec("a", "unroutable", 2),
        RowSpec("b", "normal", 3),
        RowSpec("a", "normal", 2),
        RowSpec("a", "normal", 3),
        RowSpec("a", "refused", 2),
        RowSpec("a", "unroutable", 2),
        RowSpec("a", "refused", 2),
    )
    steps = (
        Cut(drop=True),
        Return(pick=18, code=313),
        Pause(seconds=0.15),
        Junk(kind="stale_return", pick=57),
        Return(pick=52, code=312),
        Block(seconds=0.05),
        Cut(drop=True),
        Answer(nack=False, pick=17, multiple=True),
        Answer(nack=True, pick=61, multiple=True),
        Cut(drop=True),
        CloseChannel(pick=47),
        Cut(drop=True),
        Return(pick=7, code=313),
        Junk(kind="settled", pick=29),
    )
    for _ in range(3):  # timing-dependent: the probe must be lost at the right moment
        _play(Schedule(rows, steps, window=5, channels=1), template, workdir)


def test_a_return_right_after_connecting_is_retried(template: Path, workdir: Path) -> None:
    """Issue 44: after a broker restart the publisher reconnected before the queue's binding was
    back, and every row came back ``312 NO_ROUTE`` and ended ``returned``. A return in the first
    ``return_grace`` seconds of a connection is retried with backoff."""
    rows = _rows("a/normal", "a/normal", "a/normal")
    steps = (Return(pick=0, code=312), Return(pick=1, code=312), Answer(False, 2, True))
    _play(Schedule(rows, steps, window=64, channels=1), template, workdir)


def test_a_returned_probe_does_not_hold_its_exchange(template: Path, workdir: Path) -> None:
    """Found by the generator (800 schedules): every row of exchange b refused but one, which is
    unroutable. The outage's probe happened to be the unroutable row; its return (retried, in
    the grace) was no ack and no nack, so the probe never ended and the other rows stayed parked
    behind it, ``in_flight`` for ever."""
    rows = (
        RowSpec("b", "refused", 1),
        RowSpec("b", "unroutable", 3),
        RowSpec("b", "refused", 1),
        RowSpec("b", "refused", 2),
    )
    for _ in range(3):
        _play(Schedule(rows, (), window=64, channels=2), template, workdir)


def test_a_probe_returned_before_its_channel_closed_does_not_hold_its_exchange(
    template: Path, workdir: Path
) -> None:
    """Found by the generator (5,000 schedules, on the fix above): the outage's probe was
    returned and then its channel closed, so its return came with the close, not with an
    answer; the probe was never cleared and four rows stayed parked ``in_flight``. Now any row
    the write-back takes out of the publisher's hands clears a probe it was."""
    rows = (
        RowSpec("a", "normal", 1),
        RowSpec("a", "normal", 3),
        RowSpec("a", "normal", 1),
        RowSpec("b", "normal", 1),
        RowSpec("a", "normal", 3),
        RowSpec("a", "normal", 3),
    )
    steps = (
        Return(pick=0, code=312),
        Cut(drop=True),
        Answer(nack=True, pick=29, multiple=True),
        Answer(nack=False, pick=1, multiple=True),
        CloseChannel(pick=0),
        Junk(kind="settled", pick=17),
        Block(seconds=0.05),
        Return(pick=0, code=312),
        CloseChannel(pick=12),
        CloseChannel(pick=0),
    )
    for _ in range(3):
        _play(Schedule(rows, steps, window=64, channels=1), template, workdir)


# ---------------------------------------------------------------- the database loses commits


def test_a_claim_lost_under_a_publish_in_flight_is_not_published_twice(
    template: Path, workdir: Path
) -> None:
    """Issue 49, found by the generator once it could undo claims: a failover lost the claim of
    a row whose publish was on the wire (the row ``pending`` again). The next claim returned it
    while the publisher still held it, and it went out a second time, the first publish's ack
    counted nowhere. Now a claimed row that is still held keeps its publish in flight."""
    rows = _rows("a/normal", max_attempts=1)
    _play(Schedule(rows, (CloseChannel(0), Undo(0, claim=True)), 1, 1), template, workdir)


def test_lost_publishes_of_a_row_no_longer_held_are_counted(template: Path, workdir: Path) -> None:
    """Found by the generator: a channel close lost a publish (its row resent on a new
    channel), then a failover lost the row's claim; the resend's write, refused for a row no
    longer held, counted nothing. Now a lost or resent publish of a row we no longer hold is
    counted on the row all the same."""
    rows = _rows("a/normal")
    _play(Schedule(rows, (CloseChannel(0), Undo(0, claim=True)), 1, 1), template, workdir)


def test_two_resends_in_one_write_back_count_twice(template: Path, workdir: Path) -> None:
    """Found by the generator: two channel closes lost two publishes of one row; their resends
    were written by one write-back (the first had failed), and ``lost_confirms`` grew by one."""
    rows = _rows("a/normal", max_attempts=1)
    steps = (CloseChannel(0), CloseChannel(0), Undo(0, claim=True))
    _play(Schedule(rows, steps, 1, 1), template, workdir)


def test_a_refusal_of_a_row_whose_claim_was_lost_is_not_a_hot_loop(
    template: Path, workdir: Path
) -> None:
    """Found by the generator: the model's own rule, refined. A row whose claim a failover
    lost is due at once on the new primary, so its next publish may follow a nack sooner than
    the backoff (the backoff had nowhere to be written); every later refusal backs off."""
    rows = _rows("a/refused", "a/refused")
    steps = (CloseChannel(62), Undo(24, claim=True), Pause(0.15))
    _play(Schedule(rows, steps, 64, 1), template, workdir)
