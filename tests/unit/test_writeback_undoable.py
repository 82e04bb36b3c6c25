"""The write-back remembers the rows of its not-yet-durable commits until they are durable: on
PostgreSQL until the WAL on disk has passed them (the server says so at each write-back), on
SQLite for UNDO_HORIZON. After that a crash can no longer undo them, and rows found in flight
again are not counted as duplicates of them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from app.outbox.database import WalPositions
from app.publisher.dbthread import DbThread
from app.publisher.wakeup import Signal
from app.publisher.writeback import UNDO_HORIZON, Undoable, Writeback


def _writeback(
    clock: list[float], db: DbThread | None = None, *, postgres: bool = False
) -> Writeback:
    shared: Any = SimpleNamespace(
        clock=lambda: clock[0],
        db=db or DbThread(clock=lambda: clock[0]),
        store=SimpleNamespace(db=SimpleNamespace(is_postgres=postgres)),
        wake=Signal(),
    )
    return Writeback(shared)


def test_rows_of_recent_write_backs_are_undoable_until_the_horizon() -> None:
    clock = [100.0]
    wb = _writeback(clock)
    wb._undoable.append(Undoable(clock[0], [1, 2]))
    clock[0] += UNDO_HORIZON / 2
    wb._undoable.append(Undoable(clock[0], [3]))
    assert wb.undoable() == {1, 2, 3}
    clock[0] += UNDO_HORIZON / 2 + 0.01
    assert wb.undoable() == {3}  # no write-back since: the first one is durable all the same
    clock[0] += UNDO_HORIZON
    assert wb.undoable() == frozenset()


def test_postgres_forgets_a_write_back_once_the_wal_on_disk_passed_it() -> None:
    """Issue 44: with the WAL writer stalled 3 s before a crash, a fixed 2 s horizon forgot
    write-backs the crash then undid, and 996 republished rows went uncounted. The server says
    where the WAL ends and how far it is on disk; nothing is forgotten on time alone."""
    clock = [100.0]
    wb = _writeback(clock, postgres=True)
    wb._undoable.append(Undoable(clock[0], [1, 2]))
    clock[0] += 60.0  # a minute, and no word from the server: still undoable
    assert wb.undoable() == {1, 2}
    wb._durable(WalPositions(flushed=500, end=1_000))  # the next write-back: [1, 2] end by 1000
    wb._undoable.append(Undoable(clock[0], [3]))
    assert wb.undoable() == {1, 2, 3}
    wb._durable(WalPositions(flushed=999, end=2_000))  # not on disk yet (the WAL writer stalls)
    wb._undoable.append(Undoable(clock[0], [4]))
    assert wb.undoable() == {1, 2, 3, 4}
    wb._durable(WalPositions(flushed=2_000, end=2_500))  # on disk past both: durable
    assert wb.undoable() == {4}


def test_postgres_learns_nothing_while_a_failure_awaits_its_orphan_check() -> None:
    """A crash may bring the server back on a WAL that never held the last write-backs: its
    positions say nothing of them until the orphan check has looked."""
    clock = [100.0]
    db = DbThread(clock=lambda: clock[0])
    db.start()
    wb = _writeback(clock, db, postgres=True)
    wb._undoable.append(Undoable(clock[0], [1, 2]))
    with pytest.raises(OSError):
        asyncio.run(db.call(_fail))
    wb._durable(WalPositions(flushed=10**9, end=10**9))
    assert wb.undoable() == {1, 2}
    db.orphans_checked(failures_seen=db.failures)
    wb._durable(WalPositions(flushed=10**9, end=10**9))  # first: its end
    wb._durable(WalPositions(flushed=10**9 + 1, end=10**9 + 1))
    assert wb.undoable() == frozenset()
    db.stop()


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
    wb._undoable.append(Undoable(clock[0], [1, 2]))
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
