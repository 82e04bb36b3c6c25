"""The publisher's store when it settles by ranges (``OUTBOX_SETTLEMENT=ranges``, PostgreSQL;
issue 47, docs/ranges-build.md).

:class:`RangedPublisherStore` is a :class:`~app.outbox.store.PublisherStore` whose claims take
the row path's rows (keyed heads, and unkeyed rows the row path owns: ``ix_outbox_row_path_due``)
and then ranges (:class:`~app.outbox.ranges.RangeStore`): every row comes back as a
``ClaimedRow``, so the publisher's parts hold, publish and settle rows as before. What differs
is here, in the outcome calls the write-back makes:

- a confirm of a range's member writes nothing on the row; once each member of a range is
  acked or adopted, the range is settled (one write), in the same unit of work;
- any other outcome (a return, a nack, a failure, a release, a postponement, a resend) first
  *adopts* the range's members it names: the row path owns them from then on, ``in_flight``
  under the range's lease, and the outcome is written on the row as for any row;
- outstanding-confirm notes (channel and tag of a publish still unconfirmed) are not written on
  a range's members: the range's lease says they are out.

The members each held range still owes are kept in memory (:attr:`RangedPublisherStore.owed`).
Every change to them is made with the database writes it goes with and undone if their unit of
work rolls back (:meth:`~app.outbox.database.OutboxDatabase.on_rollback`), so a write-back
retried after a failure sees the same state. Claims and write-backs may run on two threads
(app/publisher/dbthread.py): a lock guards the state.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from app.outbox.database import OutboxDatabase
from app.outbox.ranges import RangeClaim, RangeStore
from app.outbox.records import Backoff, ClaimedRow, Published, RetryOutcome, ReturnedRow
from app.outbox.states import Status
from app.outbox.store import PublisherStore

log = logging.getLogger("app.outbox.ranged")
#: Ranges remembered as this store's own (a few MB at most): far more than any window holds
#: across an outage.
KNOWN_RANGES = 100_000


@dataclass
class RangeCounts:
    """What this store did with ranges (the publisher's metrics read them)."""

    claimed: int = 0  # ranges claimed
    members: int = 0  # rows published as a range's members
    settled: int = 0  # ranges settled by their confirms
    settle_lost: int = 0  # ranges whose settle found them no longer ours (lease lost)
    adopted: int = 0  # members handed to the row path for an exception
    expired: int = 0  # ranges of dead publishers closed, their members handed back
    expired_rows: int = 0


class RangedPublisherStore(PublisherStore):
    """A publisher's reads and writes when it settles by ranges."""

    def __init__(self, db: OutboxDatabase | Engine) -> None:
        super().__init__(db)
        self.ranges = RangeStore(self.db)
        self.row_path_only = True
        self._lock = threading.RLock()  # commit callbacks may run under it
        #: held range -> its members not yet acked or adopted
        self.owed: dict[int, set[int]] = {}
        self._range_of: dict[int, int] = {}  # member row id -> its held range
        self._settling: set[int] = set()  # ranges whose settle has not committed yet
        #: the ranges this store claimed lately: after an outage, one of ours leased to us but
        #: not held was settled by a write-back a crash undid (published), any other was never
        #: seen (a claim whose reply was lost)
        self._known: deque[int] = deque(maxlen=KNOWN_RANGES)
        self.counts = RangeCounts()

    # ---------------------------------------------------------------- claims

    def claim_once(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedRow]:
        """The row path's rows (keyed heads, unkeyed rows it owns), then ranges, in one
        transaction."""
        with self.db.unit_of_work():
            rows = super().claim_once(owner=owner, limit=limit, lease_seconds=lease_seconds)
            claims: list[RangeClaim] = []
            if len(rows) < limit:
                claims = self.ranges.claim(
                    owner=owner, limit=limit - len(rows), lease_seconds=lease_seconds
                )
                empty = [c.range_id for c in claims if not c.rows]
                if empty:  # every member the row path's: nothing to wait for
                    self.ranges.settle(owner=owner, range_ids=empty)
        with self._lock:
            # a row the row path gave us had been a member of a range that expired while we
            # held it (our lease ran out): the row path's now, never that range's
            for row in rows:
                range_id = self._range_of.pop(row.id, None)
                if range_id is not None:
                    self.owed.get(range_id, set()).discard(row.id)
            self._known.extend(c.range_id for c in claims)
            for claim in claims:
                if claim.rows:
                    ids = {r.id for r in claim.rows}
                    self.owed[claim.range_id] = ids
                    self._range_of.update(dict.fromkeys(ids, claim.range_id))
            self.counts.claimed += len(claims)
            self.counts.members += sum(len(c.rows) for c in claims)
        members = [r for c in claims for r in c.rows]
        return sorted([*rows, *members], key=lambda r: r.id) if members else rows

    def range_members(self, ids: Iterable[int]) -> set[int]:
        """Of ``ids``, the rows held as a range's members (their outcome is not on the row)."""
        with self._lock:
            return {i for i in ids if i in self._range_of}

    def range_of(self, row_id: int) -> int | None:
        """The held range whose member this row is, if it is one."""
        with self._lock:
            return self._range_of.get(row_id)

    def held_ranges(self) -> list[int]:
        with self._lock:
            return list(self.owed)

    # ---------------------------------------------------------------- state

    def _take(self, ids: Iterable[int]) -> dict[int, list[int]]:
        """Members among ``ids``, by range, taken out of what their ranges owe (put back if the
        unit of work rolls back). Caller holds the lock."""
        taken: dict[int, list[int]] = {}
        for row_id in ids:
            range_id = self._range_of.pop(row_id, None)
            if range_id is not None:
                taken.setdefault(range_id, []).append(row_id)
                self.owed[range_id].discard(row_id)
        if taken:
            self.db.on_rollback(lambda: self._put_back(taken))
        return taken

    def _put_back(self, taken: dict[int, list[int]]) -> None:
        with self._lock:
            for range_id, ids in taken.items():
                self.owed.setdefault(range_id, set()).update(ids)
                self._range_of.update(dict.fromkeys(ids, range_id))

    def _settle_done(self, owner: str, range_ids: Iterable[int]) -> set[int]:
        """Settle the ranges among ``range_ids`` that owe nothing more; returns those found no
        longer ours (their lease expired and another publisher closed them). Caller holds the
        lock."""
        done = [r for r in set(range_ids) if not self.owed.get(r) and r not in self._settling]
        if not done:
            return set()
        # owed (empty) until the settle commits: the orphan check, on the claim's thread,
        # must not take a range being settled for one it does not hold
        self._settling.update(done)
        settled = self.ranges.settle_ids(owner=owner, range_ids=done)
        self.db.on_commit(lambda: self._settled(done))
        self.db.on_rollback(lambda: self._settle_undone(done))
        lost = set(done) - set(settled)
        self.counts.settled += len(settled)
        self.counts.settle_lost += len(lost)
        if lost:
            log.warning(
                "%d of %d ranges to settle were no longer this publisher's (their lease "
                "expired: another publisher handed their members back, counted as possible "
                "duplicates)",
                len(lost),
                len(done),
            )
        return lost

    def _settled(self, range_ids: list[int]) -> None:
        with self._lock:
            for range_id in range_ids:
                self._settling.discard(range_id)
                if not self.owed.get(range_id):
                    self.owed.pop(range_id, None)

    def _settle_undone(self, range_ids: list[int]) -> None:
        with self._lock:
            self._settling.difference_update(range_ids)

    def _adopt(self, owner: str, ids: Iterable[int]) -> None:
        """Before an outcome other than a confirm: the named members go to the row path,
        ``in_flight`` under their range's lease; a range left owing nothing is settled."""
        with self._lock:
            taken = self._take(ids)
            if not taken:
                return
            for range_id, members in taken.items():
                adopted = self.ranges.adopt(owner=owner, range_id=range_id, ids=members)
                self.counts.adopted += len(adopted)
            self._settle_done(owner, taken)

    # ---------------------------------------------------------------- outcomes

    def mark_confirmed(
        self, *, owner: str, ids: Sequence[int] = (), published: Sequence[Published] = ()
    ) -> int:
        """Row-path rows confirmed on the row; a range's members acked, their range settled
        once it owes nothing. Counts a member as moved unless its range was no longer ours."""
        with self.db.unit_of_work():
            with self._lock:
                members = {i for i in [*ids, *(p.id for p in published)] if i in self._range_of}
                taken = self._take(members)
                lost = self._settle_done(owner, taken) if taken else set()
            moved = sum(len(v) for r, v in taken.items() if r not in lost)
            rows = [i for i in ids if i not in members]
            facts = [p for p in published if p.id not in members]
            if rows or facts:
                moved += super().mark_confirmed(owner=owner, ids=rows, published=facts)
        return moved

    def record_published(
        self,
        *,
        owner: str,
        channel_id: int,
        tags: Sequence[tuple[int, int]],
        published_at: Any = None,
    ) -> int:
        members = self.range_members(i for i, _ in tags)
        rows = [pair for pair in tags if pair[0] not in members]
        if not rows:
            return 0
        return super().record_published(
            owner=owner, channel_id=channel_id, tags=rows, published_at=published_at
        )

    def mark_returned(
        self, *, owner: str, returns: Sequence[ReturnedRow], published: Sequence[Published] = ()
    ) -> int:
        with self.db.unit_of_work():
            self._adopt(owner, (r.id for r in returns))
            return super().mark_returned(owner=owner, returns=returns, published=published)

    def mark_failed(self, *, owner: str, ids: Sequence[int], reason: str) -> int:
        with self.db.unit_of_work():
            self._adopt(owner, ids)
            return super().mark_failed(owner=owner, ids=ids, reason=reason)

    def retry(
        self,
        *,
        owner: str,
        ids: Sequence[int],
        error: str,
        backoff: Backoff,
        exhausted: Status,
        max_attempts: int | None = None,
        nack: bool = False,
    ) -> RetryOutcome:
        with self.db.unit_of_work():
            self._adopt(owner, ids)
            return super().retry(
                owner=owner,
                ids=ids,
                error=error,
                backoff=backoff,
                exhausted=exhausted,
                max_attempts=max_attempts,
                nack=nack,
            )

    def postpone(self, *, owner: str, ids: Sequence[int], error: str, delay: float) -> int:
        with self.db.unit_of_work():
            self._adopt(owner, ids)
            return super().postpone(owner=owner, ids=ids, error=error, delay=delay)

    def release(
        self,
        *,
        owner: str,
        ids: Sequence[int],
        lost: bool,
        error: str | None = None,
        delay: float = 0.0,
    ) -> int:
        with self.db.unit_of_work():
            self._adopt(owner, ids)
            return super().release(owner=owner, ids=ids, lost=lost, error=error, delay=delay)

    def resend(self, *, owner: str, ids: Sequence[int], error: str) -> int:
        with self.db.unit_of_work():
            self._adopt(owner, ids)
            return super().resend(owner=owner, ids=ids, error=error)

    def held_ids(self, *, owner: str, ids: Sequence[int]) -> set[int]:
        """Row-path rows held under ``owner``'s lease, and members of ranges it still leases."""
        members = self.range_members(ids)
        held = super().held_ids(owner=owner, ids=[i for i in ids if i not in members])
        if members:
            with self._lock:
                by_range = {self._range_of[i]: i for i in members if i in self._range_of}
            leased = set(self.ranges.leased(owner=owner, range_ids=list(by_range)))
            with self._lock:
                held |= {i for i in members if self._range_of.get(i) in leased}
        return held

    # ---------------------------------------------------------------- housekeeping

    def renew(self, *, owner: str, lease_seconds: float) -> int:
        """The heartbeat: extend the leases of the ranges this publisher holds."""
        held = self.held_ranges()
        return self.ranges.renew(owner=owner, range_ids=held, lease_seconds=lease_seconds)

    def release_expired(self) -> int:
        """Row-path leases of dead publishers, then their ranges: each member not the row
        path's yet is handed to it, pending, a possible duplicate."""
        moved = super().release_expired()
        ranges, rows = self.ranges.expire()
        if ranges:
            self.counts.expired += ranges
            self.counts.expired_rows += rows
            self.db.on_commit(self._walk_from_start)
        return moved + rows

    def release_orphans(self, *, owner: str) -> tuple[int, int]:
        """Ranges leased to ``owner`` that it does not hold, closed: a claim's whose reply was
        lost (never published: their members pending again as they were) and ours whose settle
        a database crash undid (published: possible duplicates). Safe only between claims (the
        claimer's check). Returns the rows handed back uncounted and counted."""
        with self._lock:
            held, known = list(self.owed), list(self._known)
        ranges, unseen, undone = self.ranges.orphans(owner=owner, keep=held, known=known)
        if ranges:
            self.counts.expired += ranges
            self.counts.expired_rows += unseen + undone
            self.db.on_commit(self._walk_from_start)
        return unseen, undone

    def count_open(self, *, due_within: float | None = None) -> int:
        """Rows not settled yet: the row path's pending and in-flight rows, and ranged work
        (rows past the cursor, leased ranges' rows, ended holes and lifted batches not yet
        claimed late)."""
        rows = self.ranges.open_work(due_within=due_within)
        return rows + self._row_path_open(due_within)

    def _row_path_open(self, due_within: float | None) -> int:
        return self.ranges.row_path_open(due_within=due_within)
