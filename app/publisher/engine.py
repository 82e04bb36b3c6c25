"""The publisher: drains the outbox into RabbitMQ with publisher confirms.

The engine is the composition root of small parts, each with one job. They share one
:class:`~app.publisher.wiring.Shared`, built from the settings, and wake each other through its
named signals; a confirm's whole path reads in :mod:`app.publisher.answers`.

=================  ==========================================  ===============================
part               job                                         module
=================  ==========================================  ===============================
session            connection, confirm channels, broker        :mod:`app.publisher.session`
                   callbacks -> ledger events
claimer            keep the window full: claim due rows        :mod:`app.publisher.claimer`
sender             route, encode, write; quarantine turns      :mod:`app.publisher.sender`
answers            ledger events -> outcomes (via outages and  :mod:`app.publisher.answers`
                   the pure settlement)
outages            an exchange that nacks everything: probe,   :mod:`app.publisher.outages`
                   park, judge
write-back         outcomes and outstanding tags to the DB,    :mod:`app.publisher.writeback`
                   on a deadline
housekeeping       heartbeat and report, lease sweep, confirm  :mod:`app.publisher.housekeeping`
                   timeout, until-empty
=================  ==========================================  ===============================

Every task waits on a deadline as well as on its signal. All database calls run on one thread
(:class:`~app.publisher.dbthread.DbThread`). The process serves its own ``/metrics``,
``/healthz`` and ``/readyz`` (:mod:`app.probes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from app.logs import redact_url
from app.outbox.reports import PublisherReport, read_report
from app.outbox.store import PublisherStore
from app.probes import ProbeServer, check_route, metrics_route
from app.publisher.answers import Answers
from app.publisher.claimer import Claimer
from app.publisher.housekeeping import Housekeeping
from app.publisher.listener import Listener
from app.publisher.metrics import PublisherMetrics, PublisherStats, registry_for
from app.publisher.outages import Outages
from app.publisher.sender import Sender
from app.publisher.wiring import Shared
from app.publisher.writeback import Writeback
from app.settings import Settings

log = logging.getLogger("app.publisher")

TASK_STOP_TIMEOUT = 30.0


def default_publisher_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Publisher:
    """Drains the outbox into RabbitMQ with publisher confirms. One instance runs once."""

    def __init__(
        self,
        *,
        settings: Settings,
        store: PublisherStore,
        publisher_id: str | None = None,
        metrics: PublisherMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """``rng``: jitter and the order of a multi-host URL's brokers (seed it to replay)."""
        self.settings = settings
        self.store = store
        self.publisher_id = publisher_id or settings.publisher_id or default_publisher_id()
        self.metrics = metrics or PublisherMetrics()
        self.clock = clock
        shared = self.shared = Shared.build(
            settings=settings,
            store=store,
            owner=self.publisher_id,
            metrics=self.metrics,
            clock=clock,
            rng=rng or random.Random(),
        )
        # Each part gets the shared state and wakes the others through its named signals
        # (app/publisher/wiring.py); the seams that carry data are the arguments below.
        self.writeback = Writeback(shared, gone=lambda ids: self.outages.lost(ids))
        self.sender = Sender(shared, outcomes=self.writeback.buffer)
        self.outages = Outages(
            shared,
            outcomes=self.writeback.buffer,
            unpark=self.sender.unpark,
            burst=settings.destination_nack_burst,
            outage_after=settings.destination_outage_after,
        )
        self.answers = Answers(
            shared, outages=self.outages, sender=self.sender, outcomes=self.writeback.buffer
        )
        shared.session.attach(self.answers)
        self.claimer = Claimer(
            shared,
            notified=lambda: self.listener.listening,
            settled=self.writeback.settled,
            undoable=self.writeback.undoable,
            checked=self.writeback.checked,
            confirm_held=self.writeback.confirm_held,
        )
        self.listener = Listener(url=settings.database_url.get_secret_value(), wake=shared.new_rows)
        self.housekeeping = Housekeeping(
            shared,
            report=self.report,
            idle=self._idle,
            request_stop=self.request_stop,
            until_empty=False,
        )
        self.probes: ProbeServer | None = None
        self.metrics.gauges = self._gauges
        self.metrics.ranges = getattr(store, "counts", None)  # ranges: app/outbox/ranged.py
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    # the shared state, by the names the tests and the service read
    registry = property(lambda self: self.shared.registry)
    db = property(lambda self: self.shared.db)
    session = property(lambda self: self.shared.session)
    holdings = property(lambda self: self.shared.holdings)
    quarantine = property(lambda self: self.shared.quarantine)
    destinations = property(lambda self: self.shared.destinations)
    backoff = property(lambda self: self.shared.backoff)
    limits = property(lambda self: self.shared.limits)
    spans = property(lambda self: self.shared.spans)

    # ------------------------------------------------------------ run and stop

    def request_stop(self) -> None:
        """Begin a graceful stop (safe to call from a signal handler on the loop)."""
        self._stop.set()

    async def run(
        self, *, stop: asyncio.Event | None = None, until_empty: bool = False
    ) -> PublisherStats:
        """Publish until ``stop`` is set (or, with ``until_empty``, no open row remains)."""
        self.db.start()
        try:
            previous = await self.db.call(
                self.registry.register_publisher,
                publisher_id=self.publisher_id,
                stale_after=3 * self.settings.publisher_heartbeat_interval,
            )
            self.metrics.resume(read_report(previous))
            await self._start_probes()
            self._log_start()
            await self._run_tasks(stop, until_empty)
            with contextlib.suppress(Exception):
                await self.db.call(
                    self.registry.unregister_publisher,
                    publisher_id=self.publisher_id,
                    stats=self.report().model_dump(mode="json"),
                )
        finally:
            if self.probes is not None:
                await self.probes.close()
            self.db.stop()
        stats = self.metrics.stats()
        log.info(
            "publisher %s stopped after %.1fs: published %d, confirmed %d, returned %d, "
            "failed %d, possible duplicates %d",
            self.publisher_id,
            stats.elapsed_seconds,
            stats.published,
            stats.confirmed,
            stats.returned,
            stats.failed,
            stats.lost,
        )
        return stats

    def _log_start(self) -> None:
        s = self.settings
        log.info(
            "publisher %s started: database %s, broker %s, window %d, claim batch %d, "
            "channels %d, metrics and probes at %s%s",
            self.publisher_id,
            redact_url(s.database_url.get_secret_value()),
            redact_url(s.amqp_url.get_secret_value()),
            s.window,
            s.claim_batch,
            s.channels,
            self.probes.url if self.probes else "-",
            ", a span per published batch" if self.spans is not None else "",
        )

    async def _start_probes(self) -> None:
        s = self.settings
        routes = {
            "/metrics": metrics_route(registry_for(self.metrics, publisher_id=self.publisher_id)),
            "/healthz": check_route(self._healthy),
            "/readyz": check_route(self._ready),
        }
        self.probes = ProbeServer(
            routes, host=s.publisher_metrics_host, port=s.publisher_metrics_port
        )
        try:
            await self.probes.start()
        except OSError as exc:
            if s.publisher_metrics_port == 0:
                self.probes = None
                raise RuntimeError(
                    f"cannot serve /metrics on {s.publisher_metrics_host}: {exc}"
                ) from exc
            # a second publisher on the host, another service on the port: publishing matters
            # more than the port; a scrape or probe set to that port finds nothing, and says so
            self.probes = ProbeServer(routes, host=s.publisher_metrics_host, port=0)
            await self.probes.start()
            log.error(
                "cannot serve /metrics and the probes on %s:%d (%s): serving them on %s instead "
                "(set OUTBOX_PUBLISHER_METRICS_PORT to a free port, or 0 for any)",
                s.publisher_metrics_host,
                s.publisher_metrics_port,
                exc,
                self.probes.url,
            )

    async def _run_tasks(self, stop: asyncio.Event | None, until_empty: bool) -> None:
        self.housekeeping.until_empty = until_empty
        self._tasks = {
            "session": asyncio.create_task(self.session.run(), name="outbox-session"),
            "claimer": asyncio.create_task(self.claimer.run(), name="outbox-claimer"),
            "sender": asyncio.create_task(self.sender.run(), name="outbox-sender"),
            "writeback": asyncio.create_task(self.writeback.run(), name="outbox-writeback"),
            "housekeeping": asyncio.create_task(
                self.housekeeping.run(), name="outbox-housekeeping"
            ),
        }
        if self.listener.conninfo is not None:  # PostgreSQL; SQLite only polls
            self._tasks["listener"] = asyncio.create_task(
                self.listener.run(), name="outbox-listener"
            )
        watchers = [asyncio.create_task(self._stop.wait())]
        if stop is not None:
            watchers.append(asyncio.create_task(stop.wait()))
        main = self._tasks
        try:
            done, _ = await asyncio.wait(
                [*main.values(), *watchers], return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:  # cancelled from outside: no graceful stop, no leftovers
            for task in [*main.values(), *watchers]:
                task.cancel()
            await self.session.cancel_helpers()
            raise
        crashed = [t for t in done if t in main.values() and t.exception() is not None]
        for name, task in main.items():
            if task in crashed:
                log.error("publisher task %s crashed: stopping", name, exc_info=task.exception())
        for task in watchers:
            task.cancel()
        try:
            await self._shutdown()
        finally:
            for task in main.values():
                task.cancel()
        if crashed:
            raise crashed[0].exception()  # type: ignore[misc]

    async def _shutdown(self) -> None:
        """Stop claiming, release what was never published, settle the window, release the rest."""
        log.info(
            "publisher %s stopping: %d rows held, %d publishes unconfirmed",
            self.publisher_id,
            len(self.holdings),
            self.session.outstanding(),
        )
        self._stop.set()
        self.session.stopping = True
        tasks = self._tasks
        self.listener.stop()
        self.claimer.stop()
        await _finish(tasks["claimer"])
        if "listener" in tasks:
            tasks["listener"].cancel()  # it may sit in a 5 s wait for notifications
        if self.claimer.orphans_suspected():
            with contextlib.suppress(Exception):
                await self.claimer.release_orphans()
        await self.session.cancel_helpers()
        self.sender.stop()
        await _finish(tasks["sender"])
        self._release_unpublished()
        await self._settle_window(self.settings.shutdown_timeout)
        self.session.abandon_window("publisher stopped before the confirm came")
        self._release_unpublished()  # rows of an isolated publish lost at the stop
        await self.session.close(min(5.0, self.settings.shutdown_timeout + 1))
        if self.spans is not None:
            self.spans.close()
        await _finish(tasks["session"])
        self.housekeeping.stop()
        await _finish(tasks["housekeeping"])
        self.writeback.stop()
        await _finish(tasks["writeback"])
        for _ in range(3):
            if self.writeback.out.empty() or await self.writeback.flush():
                break
        with contextlib.suppress(Exception):  # the last minute's figures (best effort)
            await self.housekeeping.sample()

    def _release_unpublished(self) -> None:
        rows = [r.id for r in self.holdings.unsent()] + self.outages.release_all()
        waiting = sorted(self.quarantine.rows() - self.quarantine.active)
        self.quarantine.drop(waiting)
        rows += waiting
        if rows:
            self.writeback.out.released.extend(rows)
            self.writeback.wake.set()

    async def _settle_window(self, timeout: float) -> None:
        deadline = self.clock() + timeout
        while self.session.outstanding() and self.session.connected:
            left = deadline - self.clock()
            if left <= 0:
                break
            await self.shared.settled.wait(min(left, 0.1))

    # ------------------------------------------------------------ observability

    def _idle(self) -> bool:
        h = self.holdings
        return not h.held and not h.queue and self.writeback.out.empty()

    def _gauges(self) -> dict[str, Any]:
        oldest = self.holdings.oldest_since()
        now = self.clock()
        return {
            "held": len(self.holdings),
            "queued": len(self.holdings.queue),
            "outstanding": self.session.outstanding(),
            "quarantined": len(self.quarantine.rows()),
            "oldest_held_age_seconds": None if oldest is None else max(0.0, now - oldest),
            "window": self.settings.window,
            "broker_unreachable_seconds": self.session.outage.seconds(),
            "paused_exchanges": sorted(self.destinations.paused(now)),
        }

    def report(self) -> PublisherReport:
        return self.metrics.report(
            metrics_url=self.probes.url + "/metrics" if self.probes and self.probes.url else None
        )

    def _healthy(self) -> tuple[bool, dict[str, object]]:
        dead = [
            n
            for n, t in self._tasks.items()
            if t.done() and not t.cancelled() and t.exception() is not None
        ]
        return not dead, {"publisher": self.publisher_id, "crashed_tasks": dead}

    def _ready(self) -> tuple[bool, dict[str, object]]:
        limit = 3 * self.settings.publisher_heartbeat_interval
        last = self.db.last_ok
        db_ok = last is not None and time.monotonic() - last <= max(limit, 5.0)
        details: dict[str, object] = {
            "publisher": self.publisher_id,
            "broker_connected": self.session.connected,
            "broker_blocked": self.session.blocked,
            "database_ok": db_ok,
            "database_error": self.db.last_error,
            "stopping": self.session.stopping,
        }
        ok = self.session.connected and db_ok and not self.session.stopping
        return ok, details


async def _finish(task: asyncio.Task[Any]) -> None:
    if task.done():
        if not task.cancelled() and task.exception() is not None:
            log.error("publisher task failed", exc_info=task.exception())
        return
    try:
        async with asyncio.timeout(TASK_STOP_TIMEOUT):
            await asyncio.shield(task)
    except TimeoutError:
        log.error(
            "publisher task %s did not stop in %.0fs: cancelled", task.get_name(), TASK_STOP_TIMEOUT
        )
        task.cancel()
    except Exception:
        log.exception("publisher task failed")
