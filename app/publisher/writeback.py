"""The write-back: settled outcomes and outstanding tags to the database, on a deadline.

Whatever the broker does, an outcome is written once the running write-back is done (after
``flush_interval``, 0 by default), and within
``outstanding_after`` (+ one flush) of a publish that is still unconfirmed its channel, delivery
tag and publish time are on its row. The loop waits on a deadline as well as on its wake-up, so it
never depends on an ack arriving (a broker that never acks still shows every outstanding confirm).

Each write-back is one transaction (:meth:`~app.outbox.database.OutboxDatabase.unit_of_work`),
one store call per outcome kind; a failure anywhere rolls all of it back and the same
outcomes go in front of the newer ones for the next try (a commit whose result is unknown is
retried too: rows it did move then count as ``lease_lost``, nothing moves twice because every
write is guarded by ``in_flight`` + owner).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from app.confirms import Sent
from app.outbox.database import WalPositions
from app.outbox.records import Published
from app.outbox.states import Status
from app.publisher.outcomes import Outcomes, Written
from app.publisher.wakeup import Signal
from app.publisher.wiring import Shared

log = logging.getLogger("app.publisher")

#: The longest the loop sleeps with nothing to write (it re-checks due tag notes after it).
IDLE_CHECK = 0.25
#: SQLite: how long the ids of a write-back committed without waiting for the disk
#: (``synchronous = NORMAL``) are remembered. PostgreSQL says when each became durable instead
#: (:class:`Undoable`): a fixed horizon there missed 996 republished rows in a crash trial whose
#: WAL writer had stalled 3 s.
UNDO_HORIZON = 2.0
#: PostgreSQL with a streaming standby whose WAL position this role may not read (it lacks
#: pg_read_all_stats): write-backs are remembered this long after they are on the local disk,
#: so a failover to a standby up to this far behind is still counted.
STANDBY_HORIZON = 60.0
#: However far behind a standby stays, a write-back is forgotten after this long (memory stays
#: bounded; a standby minutes behind is not one a failover should promote).
UNDO_LIMIT = 600.0
#: The reason written on a row a database crash or failover set back after our write-back had
#: confirmed it: someone publishes it again.
UNDONE_CONFIRM_ERROR = (
    "confirmed by a write-back that a database crash or failover undid: published again, "
    "a possible duplicate"
)
#: The reason written on a row the broker confirmed that this publisher no longer held.
AGAIN_ERROR = (
    "published by a publisher whose lease was gone (a lease swept, or a failover that undid "
    "the claim), confirmed or of unknown outcome: published again, a possible duplicate"
)


@dataclass(slots=True)
class Undoable:
    """A write-back committed without waiting for the disk, or for a standby: a database crash
    or a failover may still undo it.

    ``end``: a WAL position past its commit record (PostgreSQL), learned at the next
    write-back, whose first statement reads the positions; once the WAL is on the disk of the
    server and of every streaming standby past it, the write-back is durable and forgotten.
    None: not known yet. ``published``, ``bare``: the rows it confirmed, with (and without)
    their publish facts: the check after an outage finds which of them someone publishes
    again."""

    at: float
    ids: list[int]
    end: int | None = None
    published: list[Published] = field(default_factory=list)
    bare: list[int] = field(default_factory=list)
    local_at: float | None = None  # when the local disk had it (positions not readable)
    #: the confirmed rows' message ids: after a failover a row is found by its message id (a
    #: standby behind the primary may give its id to another message)
    messages: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Settled:
    """Rows settled by write-backs that a crash or failover may have undone (a snapshot of
    :class:`Undoable` entries): all their ids, and the confirmed ones' publish facts."""

    ids: frozenset[int]
    published: list[Published]
    bare: list[int]
    entries: tuple[int, ...] = ()  # identities of the entries, for :meth:`Writeback.checked`
    messages: dict[int, str] = field(default_factory=dict)


RETRY_PAUSE = 1.0


class Writeback:
    def __init__(
        self, shared: Shared, *, gone: Callable[[frozenset[int]], None] = lambda ids: None
    ) -> None:
        """``gone``: rows the write-back took out of this publisher's hands, however they
        ended; an outage's probe among them is no longer awaited (``Outages.lost``)."""
        self.p = shared
        self.gone = gone
        self.out = Outcomes()
        self.wake = shared.wake
        self.stopped = False
        # recent write-backs a database crash could still undo (not durable yet)
        self._undoable: deque[Undoable] = deque()
        self._standbys_unread = False  # warned: a standby's position is not readable
        self.settling: frozenset[int] = frozenset()  # rows the running write-back settles
        self._done = Signal()  # a write-back finished (settling emptied)

    def stop(self) -> None:
        """Write what is waiting, then return from :meth:`run`."""
        self.stopped = True
        self.wake.set()

    def buffer(self) -> Outcomes:
        return self.out

    def note_due(self) -> None:
        p = self.p
        p.session.due_notes(p.clock() - p.settings.outstanding_after, self.out.published)

    async def run(self) -> None:
        interval = self.p.settings.flush_interval
        while True:
            self.note_due()
            if self.out.empty():
                if self.stopped:
                    return
                await self.wake.wait(self._idle_wait())
                continue
            # ``flush_interval`` (0 by default) lets the outcomes of one interval gather; under
            # load they gather anyway while the previous write-back runs
            await asyncio.sleep(interval)
            await self.flush()

    def _idle_wait(self) -> float:
        p = self.p
        at = p.session.next_note_at()
        if at is None:
            return IDLE_CHECK
        return min(max(0.0, at + p.settings.outstanding_after - p.clock()), IDLE_CHECK)

    async def flush(self) -> bool:
        """Write what is waiting in one transaction; False when it failed (kept for later)."""
        p = self.p
        self.note_due()
        out, self.out = self.out, Outcomes()
        if out.empty():
            return True
        started = time.perf_counter()
        self.settling = frozenset(out.settled_ids())
        # a range's members: their confirm is the range's settle, never a row a crash undoes
        ranged = p.store.range_members(out.confirmed)
        try:
            written, wal = await p.db.call(self._write, out=out)
        except Exception:
            self._finished()
            p.metrics.db_errors += 1  # the outage is logged once, by the database lane
            log.debug(
                "writing %d outcomes failed; retrying in %.0fs",
                out.rows(),
                RETRY_PAUSE,
                exc_info=True,
            )
            self.out.merge(out)
            await asyncio.sleep(RETRY_PAUSE)
            return False
        p.metrics.flush_seconds.observe(time.perf_counter() - started)
        self._count(written)
        settled = list(out.settled_ids())
        if wal is not None or not p.settings.synchronous_commit:
            if wal is not None:
                self._durable(wal)
            again = set(written.again_ids) | ranged
            published, bare = _published((i for i in out.confirmed if i not in again), out.sent)
            held = p.holdings.held
            messages = {f.id: row.message_id for f in published if (row := held.get(f.id))}
            rows = [i for i in settled if i not in ranged] if ranged else settled
            self._undoable.append(
                Undoable(p.clock(), rows, published=published, bare=bare, messages=messages)
            )
            self._forget_durable()
        news = bool(out.lost or out.released or out.postponed) or self._keys_moved_on(settled)
        p.holdings.forget(settled)
        self.gone(self.settling)
        if p.spans is not None:
            p.spans.settled(out)
        self._finished()
        p.freed()
        if news:
            p.new_rows()
        return True

    def _keys_moved_on(self, settled: list[int]) -> bool:
        """Did a row with an ordering key settle? Then its key's next row may be due now, and
        no notification says so."""
        held = self.p.holdings.held
        return any(
            (row := held.get(i)) is not None and row.ordering_key is not None for i in settled
        )

    def _finished(self) -> None:
        self.settling = frozenset()
        self._done.set()

    async def settled(self, ids: Iterable[int]) -> int:
        """Return once no running write-back settles any of ``ids``: a claim on its own lane
        may return a row that the write-back running now has just released, and accepting it
        before that write-back forgets the row would lose the new claim (module dbthread).
        Returns how many of ``ids`` it waited for (0: it did not wait)."""
        ids = list(ids)
        waited = 0
        while self.settling and not self.settling.isdisjoint(ids):
            waited = waited or len(self.settling.intersection(ids))
            await self._done.wait(IDLE_CHECK)
        return waited

    def _durable(self, wal: WalPositions) -> None:
        """PostgreSQL, read at the start of the write-back just committed: every earlier one
        ended before ``wal.end``; those the WAL on disk passed, on the server and on every
        streaming standby (``wal.durable``), are durable. Not while a database call has failed
        with no orphan check since: the server may have crashed or failed over and come back on
        a WAL that never held them. A standby whose position this role may not read: kept
        :data:`STANDBY_HORIZON` after the local disk has them."""
        if self.p.db.failed_at is not None:
            return
        now = self.p.clock()
        for entry in self._undoable:
            if entry.end is None:
                entry.end = wal.end
            if entry.local_at is None and entry.end <= wal.flushed:
                entry.local_at = now
        durable = wal.durable
        if durable is None:
            self._unreadable_standbys()
        while self._undoable and (end := self._undoable[0].end) is not None:
            first = self._undoable[0]
            if durable is not None and end <= durable:
                self._undoable.popleft()
            elif durable is None and first.local_at is not None:
                if first.local_at >= now - STANDBY_HORIZON:
                    break
                self._undoable.popleft()
            elif first.at < now - UNDO_LIMIT:
                self._undoable.popleft()
            else:
                break

    def _unreadable_standbys(self) -> None:
        if self._standbys_unread:
            return
        self._standbys_unread = True
        log.warning(
            "the database streams to a standby whose WAL position this role may not read "
            "(grant it pg_read_all_stats): write-backs a failover undoes are counted as "
            "possible duplicates only if the standby was less than %.0fs behind",
            STANDBY_HORIZON,
        )

    def _forget_durable(self) -> None:
        """SQLite: drop the write-backs older than :data:`UNDO_HORIZON` before now, or before the
        first database call that failed and no orphan check has followed: on disk by then.
        (Measured from now alone, an outage longer than the horizon forgot the write-backs a
        crash had just undone, and their rows were published again as never published.)
        PostgreSQL's are dropped by :meth:`_durable` when the server says so."""
        if self.p.store.db.is_postgres:
            return
        now = self.p.clock()
        failed_at = self.p.db.failed_at
        oldest = (now if failed_at is None else min(now, failed_at)) - UNDO_HORIZON
        while self._undoable and self._undoable[0].at < oldest:
            self._undoable.popleft()

    def undoable(self) -> Settled:
        """Rows this publisher settled in commits not known durable on the server and its
        standbys: a database crash may have put them back in ``in_flight`` under our lease, a
        failover back to ``pending`` or ``in_flight`` under the lease of a claim it undid.
        Published and settled, so a re-publish of one may be a duplicate."""
        self._forget_durable()  # after an idle spell the last write-backs are durable too
        entries = list(self._undoable)
        return Settled(
            ids=frozenset(i for entry in entries for i in entry.ids),
            published=[p for entry in entries for p in entry.published],
            bare=[i for entry in entries for i in entry.bare],
            entries=tuple(id(entry) for entry in entries),
            messages={i: m for entry in entries for i, m in entry.messages.items()},
        )

    def confirm_held(self, facts: list[Published]) -> None:
        """Rows just claimed whose message this publisher had published and seen confirmed
        before a failover undid their insert (a producer wrote them again): settle them
        confirmed with that publish's facts, not publishing them again."""
        for fact in facts:
            self.out.confirmed.append(fact.id)
            self.out.sent[fact.id] = (fact.channel_id, fact.delivery_tag, fact.published_at, 0.0)
        self.wake.set()

    def checked(self, settled: Settled) -> None:
        """The check after an outage has accounted for these entries (each row found settled
        as written, or counted): forget them, so a later outage does not count them twice."""
        gone = set(settled.entries)
        self._undoable = deque(e for e in self._undoable if id(e) not in gone)

    def _count(self, w: Written) -> None:
        m = self.p.metrics
        m.flushes += 1
        m.retried += w.retried
        m.nacked_final += w.nacked_final
        m.failed += w.failed
        m.released += w.released
        m.postponed += w.postponed
        if w.moved < w.expected:
            m.lease_lost += w.expected - w.moved
            log.warning(
                "%d rows were no longer held by this publisher (lease lost)", w.expected - w.moved
            )
        if w.published_again:
            m.lost_confirms += w.published_again
            log.warning(
                "%d rows this publisher published (confirmed, or their confirm lost) were no "
                "longer held by it and will be (or were) published again: counted as possible "
                "duplicates (lost_confirms)",
                w.published_again,
            )

    # ------------------------------------------------------------ on the DB thread

    def _write(self, *, out: Outcomes) -> tuple[Written, WalPositions | None]:
        """The whole write-back in one transaction (one commit), every statement by id; with
        the WAL positions its first statement read (PostgreSQL, commits not waiting)."""
        db = self.p.store.db
        durable = self.p.settings.synchronous_commit
        with db.unit_of_work(durable=durable, by_id=True, positions=True):
            written = self._write_all(out)
        return written, db.wal_positions() if db.is_postgres else None

    def _write_all(self, out: Outcomes) -> Written:
        """One store call per outcome kind (and reason)."""
        p = self.p
        store, owner = p.store, p.owner
        settled = set(out.settled_ids())
        # publishes whose confirm will never come: a possible duplicate each, counted on rows we
        # hold; a row we no longer hold (its claim lost in a failover) is counted all the same
        doubtful = [i for ids in (*out.resent.values(), *out.lost.values()) for i in ids]
        still_held = store.held_ids(owner=owner, ids=doubtful) if doubtful else set()
        for reason, ids in out.resent.items():  # first: the same rows may settle in this batch
            store.resend(owner=owner, ids=ids, error=reason)
        for (channel_id, at), tags in out.published.items():
            still_out = [pair for pair in tags if pair[0] not in settled]
            if still_out:
                store.record_published(
                    owner=owner, channel_id=channel_id, tags=still_out, published_at=at
                )
        confirmed = self._confirm(out.confirmed, out.sent) if out.confirmed else 0
        # each a publish of its own: a row both lost a publish and had another confirmed
        # counts twice (the broker may hold both copies)
        again = self._published_again(out.confirmed, out.sent, confirmed)
        store.count_again(again, error=AGAIN_ERROR)
        unheld = [i for i in doubtful if i not in still_held]
        store.count_again(unheld, error=AGAIN_ERROR)
        again += unheld
        returned = (
            store.mark_returned(
                owner=owner,
                returns=out.returned,
                published=_published((r.id for r in out.returned), out.sent)[0],
            )
            if out.returned
            else 0
        )
        retried = final = failed = lost = released = 0
        if out.nacked:
            r = store.retry(
                owner=owner,
                ids=out.nacked,
                error="nacked by the broker",
                backoff=p.backoff,
                exhausted=Status.NACKED,
                nack=True,
            )
            retried, final = r.retried, r.exhausted
        for reason, ids in out.destination.items():
            r = store.retry(
                owner=owner,
                ids=ids,
                error=reason,
                backoff=p.backoff,
                exhausted=Status.FAILED,
                max_attempts=p.settings.destination_retry_budget,
            )
            retried, failed = retried + r.retried, failed + r.exhausted
        for reason, ids in out.failed.items():
            failed += store.mark_failed(owner=owner, ids=ids, reason=reason)
        for reason, ids in out.lost.items():
            for delay, group in self._lost_backoff(ids).items():
                lost += store.release(owner=owner, ids=group, lost=True, error=reason, delay=delay)
        if out.released:
            released = store.release(owner=owner, ids=out.released, lost=False)
        postponed = 0
        for (reason, delay), ids in out.postponed.items():
            postponed += store.postpone(owner=owner, ids=ids, error=reason, delay=delay)
        moved = confirmed + returned + retried + final + failed + lost + released + postponed
        return Written(
            len(settled),
            moved,
            confirmed,
            returned,
            retried,
            final,
            failed,
            lost,
            released,
            postponed,
            len(again),
            tuple(again),
        )

    def _lost_backoff(self, ids: list[int]) -> dict[float, list[int]]:
        """Rows whose confirm was lost, by the delay before they are due again: none on a
        row's first attempt (a connection lost once, a failover: published again at once),
        then a backoff growing with its attempts, so no broker that drops every publish's
        channel or connection makes a row go out several times a second."""
        held, backoff = self.p.holdings.held, self.p.backoff
        out: dict[float, list[int]] = {}
        for row_id in ids:
            row = held.get(row_id)
            attempts = row.attempts if row is not None else 1
            delay = round(backoff.delay(attempts - 1), 3) if attempts > 1 else 0.0
            out.setdefault(delay, []).append(row_id)
        return out

    def _published_again(self, ids: list[int], sent: dict[int, Sent], moved: int) -> list[int]:
        """Confirmed rows whose confirm could not be written (no longer held: a lease swept
        during a pause, a failover that undid a claim or a write-back) and that were or will be
        published again (:meth:`PublisherStore.published_again`): possible duplicates, each
        counted on its row."""
        if moved >= len(ids):
            return []
        published, bare = _published(ids, sent)
        return self.p.store.published_again(published, bare)

    def _confirm(self, ids: list[int], sent: dict[int, Sent]) -> int:
        published, bare = _published(ids, sent)
        return self.p.store.mark_confirmed(owner=self.p.owner, ids=bare, published=published)


def _published(ids: Iterable[int], sent: dict[int, Sent]) -> tuple[list[Published], list[int]]:
    """The rows with their publish facts, and the rows without (settled with no record of a
    publish, say by a hand-built event: confirmed all the same, no facts written)."""
    published: list[Published] = []
    bare: list[int] = []
    for row_id in ids:
        facts = sent.get(row_id)
        if facts is None or facts[2] is None:
            bare.append(row_id)
        else:
            published.append(Published(row_id, facts[0], facts[1], facts[2]))
    return published, bare
