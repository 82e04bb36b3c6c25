"""The claimer: keeps the window full. Claims ``claim_batch`` due rows while fewer than
``window`` rows are held, and only while the broker can take publishes.

Once a claim finds fewer rows than it asked for, the outbox is drained for now. With PostgreSQL
notifications up (:mod:`app.publisher.listener`), only news of rows (or the poll) brings the next
claim: a notification, or a write-back that released rows or settled a row with an ordering key
(its key's next row may be due). Room freed by other write-backs does not: it claimed an empty
outbox after each of them. Without notifications (SQLite, or the listener down), a short pause,
then a claim.

A claim whose result never reached us (its COMMIT's reply lost) may have leased rows to us all the
same; the heartbeat would renew them forever. So after a failed claim, before the next one, every
row leased to us that we do not hold is released (never published: not counted as lost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import NamedTuple

from app.outbox.records import ClaimedRow, Published
from app.publisher.wiring import Shared
from app.publisher.writeback import UNDO_LIMIT, UNDONE_CONFIRM_ERROR, Settled

log = logging.getLogger("app.publisher")

ORPHAN_ERROR = "claimed by a claim whose result was lost: released unpublished"
REUSED_ERROR = (
    "its id was handed out again after a database failover while this publisher held the old "
    "row: released unpublished"
)
#: Without notifications, the pause after a claim that caught up: the next rows gather meanwhile.
CAUGHT_UP_PAUSE = 0.002
UNDONE_ERROR = (
    "settled by a write-back that a database crash undid: published, so the next "
    "publish may be a duplicate"
)


class Orphans(NamedTuple):
    """What the check after an outage did: rows released unpublished; rows released as
    possible duplicates; rows we had confirmed found another's or confirmed by another publish
    (counted on the row); confirms written again (no republish); messages we had confirmed
    found nowhere, with their publish facts (their insert undone)."""

    unseen: int
    undone: int
    elsewhere: int
    rewritten: int
    vanished: list[tuple[str, Published]]


class Claimer:
    def __init__(
        self,
        shared: Shared,
        *,
        notified: Callable[[], bool],
        settled: Callable[[Iterable[int]], Awaitable[int]],
        undoable: Callable[[], Settled] = lambda: Settled(frozenset(), [], []),
        checked: Callable[[Settled], None] = lambda settled: None,
        confirm_held: Callable[[list[Published]], None] = lambda facts: None,
    ) -> None:
        """``notified``: new rows announce themselves (LISTEN is up); ``settled``: wait for the
        write-back settling these rows; ``undoable``: rows settled by commits a database crash
        or failover could still undo; ``checked``: those the check after an outage accounted
        for."""
        self.p = shared
        self.notified = notified
        self._after_writeback = settled
        self.undoable = undoable
        self.checked = checked
        self.confirm_held = confirm_held
        self.room = shared.room  # the window has room (or anything else worth a look)
        self.news = shared.news  # rows were committed since the last claim began
        self.stopped = False
        #: messages confirmed before a failover undid their insert: message id -> (publish
        #: facts, when found gone); a claim that returns one confirms it with those facts
        self.vanished: dict[str, tuple[Published, float]] = {}
        self.orphans_possible = False
        self._failures_seen = 0  # DB thread failures already followed by an orphan check

    async def run(self) -> None:
        p, s = self.p, self.p.settings
        threshold = max(1, min(s.claim_batch, s.window) // 2)
        while not self.stopped:
            room = s.window - len(p.holdings)
            if room < threshold or not p.session.can_publish():
                await self.room.wait(s.poll_interval)
                continue
            limit = min(s.claim_batch, room)
            rows = await self._claim(limit)
            if rows is None:
                await self.room.wait(max(s.poll_interval, 1.0))
            elif len(rows) < limit:  # caught up
                await self._caught_up(
                    pause=min(s.poll_interval, CAUGHT_UP_PAUSE) if rows else s.poll_interval
                )

    def new_rows(self) -> None:
        """The listener's wake-up: rows were committed (or made due)."""
        self.news.set()
        self.room.set()

    def stop(self) -> None:
        self.stopped = True
        self.news.set()
        self.room.set()

    async def _caught_up(self, *, pause: float) -> None:
        """After a claim that found fewer rows than it asked for: with notifications up, wait
        for news (or the poll); without, ``pause`` (rows gather meanwhile) or room freed."""
        if self.notified():
            await self.news.wait(self.p.settings.poll_interval)
        else:
            await self.room.wait(pause)

    async def _claim(self, limit: int) -> list[ClaimedRow] | None:
        p, s = self.p, self.p.settings
        retried = p.store.claims_retried
        try:
            if self.orphans_suspected():
                await self.release_orphans()
            self.news.clear()  # what was announced until now, this claim sees
            started = time.perf_counter()
            rows = await p.db.claim(
                p.store.claim, owner=p.owner, limit=limit, lease_seconds=s.lease_seconds
            )
        except Exception:
            self.orphans_possible = True
            p.metrics.db_errors += 1
            log.debug(
                "claim failed; retrying (rows it may have leased are released first)", exc_info=True
            )
            return None
        finally:  # claims the store ran again after the server ended a paused session
            p.metrics.claims_retried += p.store.claims_retried - retried
        p.metrics.claim_seconds.observe(time.perf_counter() - started)
        if rows:
            # a row still held was released by a write-back running on the other lane:
            # accept it only once that write-back has forgotten the old one (module dbthread)
            await self._settled(rows)
            p.metrics.claims += 1
            p.metrics.claimed += len(rows)
            rows = await self._not_reused(rows)
            rows = self._reappeared(rows)
            again = p.holdings.accept(rows, at=p.clock())
            if again:
                log.warning(
                    "a claim returned %d row(s) this publisher still holds: the database had "
                    "lost their claim (a failover to a standby without it, or a lease swept "
                    "while this process was paused); their publish in flight settles them, "
                    "none is published again",
                    again,
                )
            p.work.set()
        return rows

    async def _not_reused(self, rows: list[ClaimedRow]) -> list[ClaimedRow]:
        """A claimed row whose id this publisher holds for another message: a failover to a
        standby behind the primary handed that id out again. The held one's answer would
        settle the new row, unpublished: give the new row back (it is claimed again once the
        held one is settled, and published then)."""
        p = self.p
        held = p.holdings.held
        reused = [r for r in rows if (h := held.get(r.id)) and h.message_id != r.message_id]
        if not reused:
            return rows
        ids = [r.id for r in reused]
        await p.db.claim(p.store.release, owner=p.owner, ids=ids, lost=False, error=REUSED_ERROR)
        log.warning(
            "a claim returned %d row(s) whose id this publisher holds for another message (a "
            "database failover handed the ids out again): given back unpublished, to be "
            "claimed again once the held ones are settled",
            len(reused),
        )
        return [r for r in rows if r.id not in set(ids)]

    def _reappeared(self, rows: list[ClaimedRow]) -> list[ClaimedRow]:
        """Rows whose message this publisher saw confirmed before a failover undid its insert
        (a producer wrote it again): held and settled confirmed with that publish, not sent.
        Returns the rest."""
        if not self.vanished:
            return rows
        p = self.p
        now = p.clock()
        for message_id in [m for m, (_, at) in self.vanished.items() if at < now - UNDO_LIMIT]:
            del self.vanished[message_id]
        back = [r for r in rows if r.message_id in self.vanished]
        if not back:
            return rows
        p.holdings.accept(back, at=now, send=False)
        self.confirm_held([self.vanished.pop(r.message_id)[0]._replace(id=r.id) for r in back])
        p.metrics.confirms_rewritten += len(back)
        log.warning(
            "%d rows are messages we had published and seen confirmed before a database "
            "failover undid their insert (their producer wrote them again): confirmed with "
            "that publish, not published again",
            len(back),
        )
        return [r for r in rows if r.message_id not in {b.message_id for b in back}]

    async def _settled(self, rows: list[ClaimedRow]) -> None:
        started = time.perf_counter()
        waited = await self._after_writeback([r.id for r in rows])
        if waited:
            seconds = time.perf_counter() - started
            self.p.metrics.claim_wait_seconds.observe(seconds)
            log.info(
                "a claim returned %d row(s) that the running write-back was settling "
                "(released, or put back for a retry); accepted them %.1f ms later, once it "
                "had finished",
                waited,
                seconds * 1000,
            )

    def orphans_suspected(self) -> bool:
        """A claim failed (it may have leased rows unseen), or any database call failed since
        the last check (a database crash may have undone our last write-backs that did not wait
        for the disk, putting settled rows back in flight under our lease)."""
        return self.orphans_possible or self.p.db.failures != self._failures_seen

    async def release_orphans(self) -> None:
        """Give back rows leased to this publisher that it does not hold (never published)."""
        p = self.p
        failures = p.db.failures
        undoable = self.undoable()
        unseen, undone, elsewhere, rewritten, vanished = await p.db.claim(
            self._write_orphans, held=frozenset(p.holdings.held), undoable=undoable
        )
        now = p.clock()
        for message_id, fact in vanished:
            self.vanished[message_id] = (fact, now)
        if vanished:
            log.warning(
                "%d messages we had published and seen confirmed are gone from the outbox (a "
                "database failover undid their insert): if their producer writes them again "
                "(a Spark replay), they are confirmed with that publish, not published again",
                len(vanished),
            )
        self.checked(undoable)
        self.orphans_possible = False
        self._failures_seen = failures
        p.db.orphans_checked(failures_seen=failures)
        if unseen:
            p.metrics.released += unseen
            log.warning("released %d rows a failed claim had leased to us unseen", unseen)
        if undone:
            p.metrics.lost_confirms += undone
            log.warning(
                "%d rows we had settled are in flight again (a database crash undid the "
                "write-back): released to be published again, each a possible duplicate",
                undone,
            )
        if rewritten:
            p.metrics.confirms_rewritten += rewritten
            log.warning(
                "%d rows we had confirmed were set back by a database failover or crash (the "
                "write-back undone): their confirm written again, none published again",
                rewritten,
            )
        if elsewhere:
            p.metrics.lost_confirms += elsewhere
            log.warning(
                "%d rows we had confirmed are not confirmed by that publish any more (a "
                "database failover or crash undid the write-back, and the claim with it): "
                "published again by whoever claims them, each counted as a possible duplicate",
                elsewhere,
            )

    def _write_orphans(self, *, held: frozenset[int], undoable: Settled) -> Orphans:
        """DB thread. Safe only between claims: every row a finished claim returned is in
        ``held`` (settled rows have left ``in_flight`` before their ids leave ``held``).
        Rows we confirmed are found by message id where we know it (a failover to a standby
        behind the primary may have given their id to another message)."""
        p = self.p
        messages = undoable.messages
        facts = [f for f in undoable.published if f.id not in held]
        rewritten = (
            set(p.store.confirm_again(owner=p.owner, published=facts, messages=messages))
            if facts
            else set()
        )
        orphans = [
            i for i in p.store.leased_ids(owner=p.owner) if i not in held and i not in rewritten
        ]
        # ranges leased to us that we do not hold: their members back to the row path
        unseen_ranged, undone_ranged = p.store.release_orphans(owner=p.owner)
        if unseen_ranged:
            p.metrics.released += unseen_ranged
            log.warning(
                "released %d rows of ranges a failed claim had leased to us unseen",
                unseen_ranged,
            )
        if undone_ranged:
            p.metrics.lost_confirms += undone_ranged
            log.warning(
                "%d rows of ranges we had settled are leased to us again (a database crash "
                "undid the settle): handed back to be published again, each a possible duplicate",
                undone_ranged,
            )
        undone = [i for i in orphans if i in undoable.ids]
        unseen = [i for i in orphans if i not in undoable.ids]
        mine = set(undone)
        known = [f for f in facts if f.id in messages and f.id not in mine]
        elsewhere, vanished = p.store.recheck(known, messages) if known else ([], [])
        elsewhere += p.store.published_again(
            [f for f in facts if f.id not in messages and f.id not in mine | rewritten],
            [i for i in undoable.bare if i not in mine | rewritten and i not in held],
        )
        gone = set(vanished)
        lost_rows = [(messages[f.id], f) for f in known if messages[f.id] in gone]
        if not orphans and not elsewhere:
            return Orphans(0, 0, 0, len(rewritten), lost_rows)
        with p.store.db.unit_of_work():
            released = (
                p.store.release(owner=p.owner, ids=unseen, lost=False, error=ORPHAN_ERROR)
                if unseen
                else 0
            )
            lost = (
                p.store.release(owner=p.owner, ids=undone, lost=True, error=UNDONE_ERROR)
                if undone
                else 0
            )
            counted = p.store.count_again(elsewhere, error=UNDONE_CONFIRM_ERROR)
        return Orphans(released, lost, counted, len(rewritten), lost_rows)
