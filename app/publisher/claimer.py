"""The claimer: keeps the window full. Claims ``claim_batch`` due rows while fewer than
``window`` rows are held, and only while the broker can take publishes.

A claim whose result never reached us (its COMMIT's reply lost) may have leased rows to us all the
same; the heartbeat would renew them forever. So after a failed claim, before the next one, every
row leased to us that we do not hold is released (never published: not counted as lost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.outbox.repository import ClaimedRow, OutboxRepository
from app.publisher.dbthread import DbThread
from app.publisher.holdings import Holdings
from app.publisher.metrics import PublisherMetrics
from app.publisher.session import Session
from app.publisher.wakeup import Signal
from app.settings import Settings

log = logging.getLogger("app.publisher")

ORPHAN_ERROR = "claimed by a claim whose result was lost: released unpublished"


@dataclass
class ClaimerParts:
    settings: Settings
    repo: OutboxRepository
    db: DbThread
    owner: str
    holdings: Holdings
    session: Session
    metrics: PublisherMetrics
    accepted: Callable[[], None]  # wake the sender
    clock: Callable[[], float]


class Claimer:
    def __init__(self, parts: ClaimerParts) -> None:
        self.p = parts
        self.room = Signal()
        self.stopped = False
        self.orphans_possible = False

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
            elif not rows:  # idle: poll
                await self.room.wait(s.poll_interval)
            elif len(rows) < limit:  # caught up: a short pause lets the next rows gather
                await self.room.wait(min(s.poll_interval, s.flush_interval))

    async def _claim(self, limit: int) -> list[ClaimedRow] | None:
        p, s = self.p, self.p.settings
        try:
            if self.orphans_possible:
                await self.release_orphans()
            started = time.perf_counter()
            rows = await p.db.call(p.repo.claim, owner=p.owner, limit=limit,
                                   lease_seconds=s.lease_seconds)  # fmt: skip
        except Exception:
            self.orphans_possible = True
            p.metrics.db_errors += 1
            log.exception("claim failed; retrying (rows it may have leased are released first)")
            return None
        p.metrics.claim_seconds.observe(time.perf_counter() - started)
        if rows:
            p.metrics.claims += 1
            p.metrics.claimed += len(rows)
            p.holdings.accept(rows, at=p.clock())
            p.accepted()
        return rows

    async def release_orphans(self) -> None:
        """Give back rows leased to this publisher that it does not hold (never published)."""
        p = self.p
        released = await p.db.call(self._write_orphans, held=frozenset(p.holdings.held))
        self.orphans_possible = False
        if released:
            p.metrics.released += released
            log.warning("released %d rows a failed claim had leased to us unseen", released)

    def _write_orphans(self, *, held: frozenset[int]) -> int:
        """DB thread. Safe only between claims: every row a finished claim returned is in
        ``held`` (settled rows have left ``in_flight`` before their ids leave ``held``)."""
        p = self.p
        orphans = [i for i in p.repo.leased_ids(owner=p.owner) if i not in held]
        if not orphans:
            return 0
        return p.repo.release(owner=p.owner, ids=orphans, lost=False, error=ORPHAN_ERROR)
