"""What the publisher owes the database: settled outcomes and notes of slow publishes. Pure.

The broker's answers are settled on the event loop (see :mod:`app.publisher.settlement`) into an
:class:`Outcomes` buffer; the write-back (:mod:`app.publisher.writeback`) swaps the buffer out and
writes it in one transaction, one store call per outcome kind.

A publish still unconfirmed ``outstanding_after`` seconds after it was written is *due* (the
confirm ledger says which: :meth:`app.confirms.ChannelLedger.due_notes`): its channel, delivery
tag and publish time go into ``published`` and are written to its row, which is what operators
see as an outstanding confirm. Most publishes are confirmed sooner and never cost that write.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from app.confirms import Sent, TagNoteMap
from app.outbox.records import ReturnedRow


def _add(group: dict[str, list[int]], key: str, ids: Iterable[int]) -> None:
    group.setdefault(key, []).extend(ids)


@dataclass(slots=True)
class Outcomes:
    """Settled outcomes waiting for the next write-back.

    ``lost``: published, confirm never came: back to pending, a possible duplicate.
    ``released``: never published: back to pending as they were.
    ``resent``: published, confirm never came, kept held for an isolated publish (quarantine):
    the row's attempt and ``lost_confirms`` go up, it stays ``in_flight``.
    ``postponed``: a destination outage (:mod:`app.publisher.nackruns`): back to pending after
    the given delay, no budget spent, keyed by (reason, delay in seconds).
    ``sent``: where and when the confirmed and returned rows went out (the ledger's facts).
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
    postponed: dict[tuple[str, float], list[int]] = field(default_factory=dict)
    sent: dict[int, Sent] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (
            self.published
            or self.confirmed
            or self.returned
            or self.nacked
            or self.lost
            or self.released
            or self.failed
            or self.destination
            or self.resent
            or self.postponed
        )

    def lose(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.lost, reason, ids)

    def fail(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.failed, reason, ids)

    def back_off(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.destination, reason, ids)

    def resend(self, reason: str, ids: Iterable[int]) -> None:
        _add(self.resent, reason, ids)

    def postpone(self, reason: str, delay: float, ids: Iterable[int]) -> None:
        self.postponed.setdefault((reason, round(delay, 3)), []).extend(ids)

    def settled_ids(self) -> Iterable[int]:
        """Rows this write-back takes out of this publisher's hands (``resent`` stay held)."""
        yield from self.confirmed
        yield from (r.id for r in self.returned)
        yield from self.nacked
        yield from self.released
        for group in (self.lost, self.failed, self.destination):
            for ids in group.values():
                yield from ids
        for ids in self.postponed.values():
            yield from ids

    def rows(self) -> int:
        """How many row outcomes are waiting (tag notes not counted)."""
        grouped = (self.lost, self.failed, self.destination, self.resent)
        return (
            len(self.confirmed)
            + len(self.returned)
            + len(self.nacked)
            + len(self.released)
            + sum(len(ids) for g in grouped for ids in g.values())
            + sum(len(ids) for ids in self.postponed.values())
        )

    def merge(self, older: Outcomes) -> None:
        """Put a failed write-back's outcomes back in front of the newer ones."""
        for batch, tags in older.published.items():
            self.published[batch] = tags + self.published.get(batch, [])
        self.confirmed[:0] = older.confirmed
        self.sent.update(older.sent)
        self.returned[:0] = older.returned
        self.nacked[:0] = older.nacked
        self.released[:0] = older.released
        for mine, theirs in (
            (self.lost, older.lost),
            (self.failed, older.failed),
            (self.destination, older.destination),
            (self.resent, older.resent),
        ):
            for key, ids in theirs.items():
                mine[key] = ids + mine.get(key, [])
        for pkey, ids in older.postponed.items():
            self.postponed[pkey] = ids + self.postponed.get(pkey, [])


@dataclass(frozen=True, slots=True)
class Written:
    """What one write-back moved in the database (counts the store returned)."""

    expected: int
    moved: int
    confirmed: int
    returned: int
    retried: int
    nacked_final: int
    failed: int
    lost: int
    released: int
    postponed: int = 0
    #: confirmed rows whose confirm could not be written and that are published again
    published_again: int = 0
    again_ids: tuple[int, ...] = ()
