"""The write-back remembers the rows of its not-yet-durable commits until they are durable: on
PostgreSQL until the WAL on the disk of the server and of every streaming standby has passed
them (the server says so at each write-back), on SQLite for UNDO_HORIZON. After that neither a
crash nor a failover can undo them, and rows found in flight again are not counted as
duplicates of them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from app.outbox.database import WalPositions
from app.publisher.dbthread import DbThread
from app.publisher.wakeup import Signal
from app.publisher.writeback import (
    STANDBY_HORIZON,
    UNDO_HORIZON,
    UNDO_LIMIT,
    Undoable,
    Writeback,
)


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
    assert wb.undoable().ids == {1, 2, 3}
    clock[0] += UNDO_HORIZON / 2 + 0.01
    assert wb.undoable().ids == {3}  # no write-back since: the first one is durable all the same
    clock[0] += UNDO_HORIZON
    assert wb.undoable().ids == frozenset()


def test_postgres_forgets_a_write_back_once_the_wal_on_disk_passed_it() -> None:
    """Issue 44: with the WAL writer stalled 3 s before a crash, a fixed 2 s horizon forgot
    write-backs the crash then undid, and 996 republished rows went uncounted. The server says
    where the WAL ends and how far it is on disk; nothing is forgotten on time alone."""
    clock = [100.0]
    wb = _writeback(clock, postgres=True)
    wb._undoable.append(Undoable(clock[0], [1, 2]))
    clock[0] += 60.0  # a minute, and no word from the server: still undoable
    assert wb.undoable().ids == {1, 2}
    wb._durable(WalPositions(flushed=500, end=1_000))  # the next write-back: [1, 2] end by 1000
    wb._undoable.append(Undoable(clock[0], [3]))
    assert wb.undoable().ids == {1, 2, 3}
    wb._durable(WalPositions(flushed=999, end=2_000))  # not on disk yet (the WAL writer stalls)
    wb._undoable.append(Undoable(clock[0], [4]))
    assert wb.undoable().ids == {1, 2, 3, 4}
    wb._durable(WalPositions(flushed=2_000, end=2_500))  # on disk past both: durable
    assert wb.undoable().ids == {4}


def test_postgres_waits_for_the_slowest_standby_too() -> None:
    """Issue 49: an asynchronous standby 3 s behind lost 8,000 write-backs in a failover, and
    none was counted. A write-back is durable once the server's disk and every standby's have
    it (a commit that waits for the local disk included)."""
    clock = [100.0]
    wb = _writeback(clock, postgres=True)
    wb._undoable.append(Undoable(clock[0], [1]))
    wb._durable(WalPositions(flushed=5_000, end=1_000, standbys=800))  # [1] ends by 1000
    wb._undoable.append(Undoable(clock[0], [2]))
    assert wb.undoable().ids == {1, 2}  # on the server's disk, not on the standby's
    wb._durable(WalPositions(flushed=6_000, end=3_000, standbys=1_000))
    assert wb.undoable().ids == {2}
    wb._durable(WalPositions(flushed=7_000, end=4_000, standbys=2_999))
    assert wb.undoable().ids == {2}
    wb._durable(WalPositions(flushed=7_000, end=4_000, standbys=3_000))
    assert wb.undoable().ids == frozenset()


def test_a_standby_whose_position_cannot_be_read_keeps_write_backs_for_a_horizon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A role without pg_read_all_stats sees the standby but not its position: the write-backs
    are kept STANDBY_HORIZON after the local disk has them, and an operator is told once."""
    clock = [100.0]
    wb = _writeback(clock, postgres=True)
    wb._undoable.append(Undoable(clock[0], [1]))
    with caplog.at_level("WARNING", logger="app.publisher"):
        wb._durable(WalPositions(flushed=2_000, end=1_000, standbys=-1))
        clock[0] += STANDBY_HORIZON - 1
        wb._durable(WalPositions(flushed=3_000, end=2_500, standbys=-1))
        assert wb.undoable().ids == {1}
        clock[0] += 2
        wb._durable(WalPositions(flushed=3_000, end=2_500, standbys=-1))
        assert wb.undoable().ids == frozenset()
    warned = [r.getMessage() for r in caplog.records if "pg_read_all_stats" in r.getMessage()]
    assert len(warned) == 1


def test_a_standby_that_never_catches_up_costs_bounded_memory() -> None:
    clock = [100.0]
    wb = _writeback(clock, postgres=True)
    wb._undoable.append(Undoable(clock[0], [1]))
    wb._durable(WalPositions(flushed=2_000, end=1_000, standbys=0))
    clock[0] += UNDO_LIMIT + 1
    wb._undoable.append(Undoable(clock[0], [2]))
    wb._durable(WalPositions(flushed=3_000, end=2_000, standbys=0))
    assert wb.undoable().ids == {2}


def test_the_check_after_an_outage_forgets_what_it_accounted_for_and_nothing_newer() -> None:
    """A row the check counted is not counted again by the next outage's check."""
    clock = [100.0]
    wb = _writeback(clock, postgres=True)
    wb._undoable.append(Undoable(clock[0], [1, 2], bare=[1]))
    seen = wb.undoable()
    wb._undoable.append(Undoable(clock[0], [3], bare=[3]))  # settled while the check ran
    wb.checked(seen)
    assert wb.undoable().ids == {3}
    assert wb.undoable().bare == [3]


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
    assert wb.undoable().ids == {1, 2}
    db.orphans_checked(failures_seen=db.failures)
    wb._durable(WalPositions(flushed=10**9, end=10**9))  # first: its end
    wb._durable(WalPositions(flushed=10**9 + 1, end=10**9 + 1))
    assert wb.undoable().ids == frozenset()
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
    assert wb.undoable().ids == {1, 2}  # the check after the outage still sees them
    db.orphans_checked(failures_seen=failures_seen)  # the check ran: the horizon thaws
    assert wb.undoable().ids == frozenset()
    db.stop()


def test_an_outage_is_logged_once_and_its_end_with_its_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [0.0]
    db = DbThread(clock=lambda: clock[0])
    db.start()

    async def outage() -> None:
        for n in range(50):
            with pytest.raises(OSError):
                await db.call(_fail)
            clock[0] += 0.1
            if n % 10 == 0:  # a session the server has not ended yet answers: not the end
                await db.call(lambda: None)
        clock[0] += 0.9  # a call that succeeds a second after the last failure: the end
        await db.call(lambda: None)

    try:
        with caplog.at_level("DEBUG", logger="app.publisher"):
            asyncio.run(outage())
    finally:
        db.stop()
    lines = [r for r in caplog.records if r.name == "app.publisher"]
    assert [r.levelname for r in lines] == ["WARNING", "INFO"]
    assert "answers again after 5.9s (50 calls failed meanwhile)" in lines[1].getMessage()
