"""The write-back remembers the rows of its not-yet-durable commits for UNDO_HORIZON only: after
that (a new write-back or not) a crash can no longer undo them, and rows found in flight again
are not counted as duplicates of them."""

from __future__ import annotations

from typing import Any

from app.publisher.writeback import UNDO_HORIZON, Writeback, WritebackParts


def _writeback(clock: list[float]) -> Writeback:
    parts: dict[str, Any] = dict.fromkeys(WritebackParts.__dataclass_fields__)
    parts["clock"] = lambda: clock[0]
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
