"""What the publisher holds: a claim that returns a row it still holds (the database lost the
claim of it: a failover to a standby without it, a lease swept while the process was paused)
does not queue the row again."""

from __future__ import annotations

from app.outbox.records import ClaimedRow
from app.publisher.holdings import Holdings


def _row(row_id: int, attempts: int = 1) -> ClaimedRow:
    return ClaimedRow(
        row_id, f"m{row_id}", "b", "ex", "rk", False, b"x", None, None, None, None, attempts, 10
    )


def test_a_row_claimed_again_while_held_takes_the_new_lease_and_is_not_queued_again() -> None:
    held = Holdings()
    assert held.accept([_row(1), _row(2)], at=1.0) == 0
    assert [r.id for r in held.take(2)] == [1, 2]  # both published, awaiting the broker
    assert held.accept([_row(2, attempts=1), _row(3)], at=2.0) == 1
    assert [r.id for r in held.queue] == [3]  # row 2's publish in flight settles it
    assert held.held[2].attempts == 1 and held.since[2] == 1.0 and held.since[3] == 2.0
    assert len(held) == 3
