"""The write-back remembers the rows of its not-yet-durable commits for UNDO_HORIZON only: after
that (a new write-back or not) a crash can no longer undo them, and rows found in flight again
are not counted as duplicates of them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.publisher.dbthread import DbThread
from app.publisher.writeback import UNDO_HORIZON, Writeback, WritebackParts


def _writeback(clock: list[float], db: DbThread | None = None) -> Writeback:
    parts: dict[str, Any] = dict.fromkeys(WritebackParts.__dataclass_fields__)
    parts["clock"] = lambda: clock[0]
    parts["db"] = db or DbThread(clock=lambda: clock[0])
    return Writeback(WritebackParts(**parts))


def test_rows_of_recent_write_backs_are_undoable_until_the_horizon() -> None:
    clock = [100.0]
    wb = _writeback(clock)
    wb._undoable.append((clock[0], [1, 2]))
    clock[0] += UNDO_HORIZON / 2
    wb._undoable.append((clock[0], [3]))
    assert wb.undoable() == {1, 2, 3}
    clock[0] += UNDO_HORIZON / 2 + 0.01
    assert wb.undoable() == {3}  # no write-back since: the first one is durable all the same
    clock[0] += UNDO_HORIZON
    assert wb.undoable() == frozenset()


def _fail() -> None:
    raise OSError("connection refused")


def test_the_horizon_is_frozen_at_the_first_failed_call_until_the_orphan_check() -> None:
    """The reliability review's PostgreSQL crash: rows acked and written back 75 ms before the
    crash, an 8-11 s outage, then the orphan check. Measured from the check, the write-back was
    long forgotten and its rows, put back in flight by the crash, were published again as never
    published (uncounted duplicates). Measured from the first failed call, they are undoable."""
    clock = [100.0]
    db = DbThread(clock=lambda: clock[0])
    db.start()
    wb = _writeback(clock, db)
    wb._undoable.append((clock[0], [1, 2]))
    clock[0] += 0.075
    with pytest.raises(OSError):
        asyncio.run(db.call(_fail))  # the crash: the first call that fails
    failures_seen = db.failures
    clock[0] += 10.0  # the outage, longer than the horizon
    assert wb.undoable() == {1, 2}  # the check after the outage still sees them
    db.orphans_checked(failures_seen=failures_seen)  # the check ran: the horizon thaws
    assert wb.undoable() == frozenset()
    db.stop()


def test_an_outage_is_logged_once_and_its_end_with_its_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [0.0]
    db = DbThread(clock=lambda: clock[0])
    db.start()

    async def outage() -> None:
        for _ in range(50):
            with pytest.raises(OSError):
                await db.call(_fail)
            clock[0] += 0.1
        await db.call(lambda: None)

    try:
        with caplog.at_level("DEBUG", logger="app.publisher"):
            asyncio.run(outage())
    finally:
        db.stop()
    lines = [r for r in caplog.records if r.name == "app.publisher"]
    assert [r.levelname for r in lines] == ["WARNING", "INFO"]
    assert "answers again after 5.0s (50 calls failed meanwhile)" in lines[1].getMessage()
