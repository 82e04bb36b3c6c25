"""What the publisher owes the database: settled outcomes and notes of slow publishes. Pure.

The broker's answers are settled on the event loop (see :mod:`app.publisher.settlement`) into an
:class:`Outcomes` buffer; the write-back (:mod:`app.publisher.writeback`) swaps the buffer out and
writes it in one transaction, one repository call per outcome kind.

:class:`TagNotes` remembers each publish write (channel, first tag, rows, time) until its rows
settle. A publish still unconfirmed ``outstanding_after`` seconds after it was written is *due*:
its channel, delivery tag and publish time are written to its row, which is what operators see as
an outstanding confirm. Most publishes are confirmed sooner and never cost that write.
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from app.outbox.records import ReturnedRow

#: Where and when a row went out: (channel id, delivery tag, wall-clock publish time).
SentFacts = tuple[int, int, dt.datetime]
#: Late tag notes: (channel id, publish time) -> [(row id, delivery tag)].
TagNoteMap = dict[tuple[int, dt.datetime], list[tuple[int, int]]]


def _add(group: dict[str, list[int]], key: str, ids: Iterable[int]) -> None:
    group.setdefault(key, []).extend(ids)


@dataclass(slots=True)
class Outcomes:
    """Settled outcomes waiting for the next write-back.

    ``lost``: published, confirm never came: back to pending, a possible duplicate.
    ``released``: never published: back to pending as they were.
    ``resent``: published, confirm never came, kept held for an isolated publish (quarantine):
    the row's attempt and ``lost_confirms`` go up, it stays ``in_flight``.
    """

    published: TagNoteMap = field(default_factory=dict)
    confirmed: list[int] = field(default_factory=list)
    returned: list[ReturnedRow] = field(default_factory=list)
    nacked: list[int] = field(default_factory=list)
    lost: dict[str, list[int]] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)
    failed: dict[str, list[int]] = field(default_factory=dict)
    destination: dict[str, list[int]] = field(default_factory=dict)
    resent: dict[str, list[int]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.published or self.confirmed or self.returned or self.nacked
                    or self.lost or self.released or self.failed or self.destination
                    or self.resent)  # fmt: skip

    def lose(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.lost, reason, ids)

    def fail(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.failed, reason, ids)

    def back_off(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.destination, reason, ids)

    def resend(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.resent, reason, ids)

    def settled_ids(self) -> Iterable[int]:
        """Rows this write-back takes out of this publisher's hands (``resent`` stay held)."""
        yield from self.confirmed
        yield from (r.id for r in self.returned)
        yield from self.nacked
        yield from self.released
        for group in (self.lost, self.failed, self.destination):
            for ids in group.values():
                yield from ids

    def rows(self) -> int:
        """How many row outcomes are waiting (tag notes not counted)."""
        grouped = (self.lost, self.failed, self.destination, self.resent)
        return (len(self.confirmed) + len(self.returned) + len(self.nacked) + len(self.released)
                + sum(len(ids) for g in grouped for ids in g.values()))  # fmt: skip

    def merge(self, older: Outcomes) -> None:
        """Put a failed write-back's outcomes back in front of the newer ones."""
        for batch, tags in older.published.items():
            self.published[batch] = tags + self.published.get(batch, [])
        self.confirmed[:0] = older.confirmed
        self.returned[:0] = older.returned
        self.nacked[:0] = older.nacked
        self.released[:0] = older.released
        for mine, theirs in ((self.lost, older.lost), (self.failed, older.failed),
                             (self.destination, older.destination),
                             (self.resent, older.resent)):  # fmt: skip
            for key, ids in theirs.items():
                mine[key] = ids + mine.get(key, [])


@dataclass(frozen=True, slots=True)
class Written:
    """What one write-back moved in the database (counts the repository returned)."""

    expected: int
    moved: int
    confirmed: int
    returned: int
    retried: int
    nacked_final: int
    failed: int
    lost: int
    released: int


@dataclass(frozen=True, slots=True)
class PublishRun:
    """One publish write: rows ``ids`` got the contiguous tags from ``first_tag`` on
    ``channel_id`` (ledger generation ``ledger``) at monotonic ``at`` / wall-clock ``wall``."""

    at: float
    channel_id: int
    ledger: object
    first_tag: int
    ids: list[int]
    wall: dt.datetime


#: ``still_out(run, tag) -> row id`` of an unsettled publish of that run, or None.
StillOut = Callable[[PublishRun, int], int | None]


class TagNotes:
    """Publish runs waiting to become due for a tag note, oldest first."""

    def __init__(self, *, after: float) -> None:
        self.after = after
        self._runs: deque[PublishRun] = deque()

    def add(self, run: PublishRun) -> None:
        self._runs.append(run)

    def __len__(self) -> int:
        return len(self._runs)

    def due(self, now: float, still_out: StillOut, into: TagNoteMap) -> int:
        """Move the unsettled publishes of every run older than ``after`` into ``into``;
        return how many publishes were noted."""
        runs = self._runs
        noted = 0
        while runs and runs[0].at <= now - self.after:
            run = runs.popleft()
            still = [(row, tag) for tag in range(run.first_tag, run.first_tag + len(run.ids))
                     if (row := still_out(run, tag)) is not None]  # fmt: skip
            if still:
                into.setdefault((run.channel_id, run.wall), []).extend(still)
                noted += len(still)
        return noted

    def next_due_in(self, now: float) -> float | None:
        """Seconds until the oldest run is due (0 when it is), None when there is none."""
        if not self._runs:
            return None
        return max(0.0, self._runs[0].at + self.after - now)
