"""Housekeeping: the heartbeat (lease renewal and the publisher's report), the sweep of expired
leases of dead publishers, the confirm timeout, and the until-empty stop. Each on its own
deadline; ``beat_now`` sends the report at once (the broker blocked or unblocked us).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.outbox.reports import PublisherReport
from app.publisher.wiring import Shared

log = logging.getLogger("app.publisher")


class Housekeeping:
    def __init__(
        self,
        shared: Shared,
        *,
        report: Callable[[], PublisherReport],
        idle: Callable[[], bool],
        request_stop: Callable[[], None],
        until_empty: bool,
    ) -> None:
        """``idle``: nothing held, queued or waiting to be written (the until-empty stop)."""
        self.p = shared
        self.report = report
        self.idle = idle
        self.request_stop = request_stop
        self.until_empty = until_empty
        self.beat_now = shared.beat
        self.stopped = False
        #: the confirm latency histogram's counts at the last sample (the next one's start)
        self._sampled_latency = list(shared.metrics.confirm_latency.counts)

    def stop(self) -> None:
        """Return from :meth:`run` after the beat or sweep in hand."""
        self.stopped = True
        self.beat_now.set()

    @property
    def beat_every(self) -> float:
        s = self.p.settings
        return min(s.publisher_heartbeat_interval, s.lease_seconds / 3)

    async def run(self) -> None:
        p, s = self.p, self.p.settings
        next_beat = next_sweep = next_sample = 0.0
        while not self.stopped:
            now = p.clock()
            try:
                if now >= next_beat:
                    await self.beat()
                    next_beat = now + self.beat_every
                if now >= next_sample:
                    next_sample = now + s.publisher_sample_interval
                    await self.sample()
                if now >= next_sweep:
                    await self._sweep()
                    next_sweep = now + s.lease_seconds / 2
                if self.until_empty and await self._drained():
                    log.info("outbox drained: stopping")
                    self.request_stop()
                    return
            except Exception:  # a database call: the outage is logged once, by its lane
                p.metrics.db_errors += 1
                log.debug("housekeeping failed; trying again", exc_info=True)
            p.session.check_confirm_timeout(p.clock())
            if await self.beat_now.wait(min(1.0, s.poll_interval)):
                next_beat = 0.0

    async def beat(self) -> None:
        """Renew the leases of the rows we hold and write our report. Only rows we know we hold:
        one leased to us unseen (a claim whose reply was lost) must expire and come back."""
        p = self.p
        held = list(p.holdings.held)
        ranged = p.store.range_members(held)  # their range's lease is renewed, not the row's
        await p.db.call(
            p.registry.heartbeat,
            publisher_id=p.owner,
            lease_seconds=p.settings.lease_seconds,
            held=[i for i in held if i not in ranged] if ranged else held,
            stats=self.report().model_dump(mode="json"),
        )
        if ranged:
            await p.db.call(p.store.renew, owner=p.owner, lease_seconds=p.settings.lease_seconds)

    async def sample(self) -> None:
        """Write this publisher's figures to ``outbox_samples``: its counters and the confirm
        latency since the last sample (what the console charts per minute)."""
        p = self.p
        m = p.metrics
        latency = m.confirm_latency
        p50, p99 = (latency.quantile(q, since=self._sampled_latency) for q in (0.5, 0.99))
        counts = list(latency.counts)
        await p.db.call(
            p.registry.record_sample,
            publisher_id=p.owner,
            published=int(m.total("published")),
            confirmed=int(m.total("confirmed")),
            failed=int(sum(m.total(name) for name in ("returned", "nacked_final", "failed"))),
            lost=int(m.total("lost_confirms")),
            latency_p50_ms=None if p50 is None else p50 * 1000,
            latency_p99_ms=None if p99 is None else p99 * 1000,
        )
        self._sampled_latency = counts

    async def _sweep(self) -> None:
        p = self.p
        swept = await p.db.call(p.store.release_expired)
        if swept:
            # each swept row may have been on the wire: a possible duplicate, as the row's own
            # lost_confirms says (ours too, after an outage longer than the lease)
            p.metrics.lost_confirms += swept
            log.warning(
                "released %d rows of expired leases (a publisher died holding them; "
                "each may be published twice)",
                swept,
            )

    async def _drained(self) -> bool:
        p = self.p
        if not self.idle():
            return False
        # a row backing off comes due within backoff_max: wait for it; later ones (a delayed
        # message) are the next run's
        return await p.db.call(p.store.count_open, due_within=p.settings.backoff_max) == 0
