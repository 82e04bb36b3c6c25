"""The publisher: drains the outbox into RabbitMQ with publisher confirms.

The engine is the composition root of small parts, each with one job and one task:

=================  ==========================================  ===============================
part               job                                           module
=================  ==========================================  ===============================
session            connection, confirm channels, broker          :mod:`app.publisher.session`
                   callbacks -> ledger events
claimer            keep the window full: claim due rows          :mod:`app.publisher.claimer`
sender             route, encode, write; quarantine turns        :mod:`app.publisher.sender`
settlement (pure)  ledger events + close cause -> outcomes       :mod:`app.publisher.settlement`
write-back         outcomes and outstanding tags to the DB,      :mod:`app.publisher.writeback`
                   on a deadline
housekeeping       heartbeat and report, lease sweep, confirm    :mod:`app.publisher.housekeeping`
                   timeout, until-empty
=================  ==========================================  ===============================

State they share is held in plain objects (:class:`~app.publisher.holdings.Holdings`, the
quarantine, the write-back's outcome buffer); every task waits on a deadline as well as on its
wake-up signal. All database calls run on one thread (:class:`~app.publisher.dbthread.DbThread`).
The process serves its own ``/metrics``, ``/healthz`` and ``/readyz`` (:mod:`app.probes`).
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

from app.confirms import Confirmed, Event, Lost, Nacked
from app.logs import redact_url
from app.outbox.content import Limits
from app.outbox.records import Backoff
from app.outbox.registry import PublisherRegistry
from app.outbox.reports import PublisherReport, read_report
from app.outbox.store import PublisherStore
from app.probes import ProbeServer, check_route, metrics_route
from app.publisher.claimer import Claimer, ClaimerParts
from app.publisher.dbthread import DbThread
from app.publisher.destinations import Destinations
from app.publisher.holdings import Holdings
from app.publisher.housekeeping import Housekeeping, HousekeepingParts
from app.publisher.listener import Listener
from app.publisher.metrics import PublisherMetrics, PublisherStats, registry_for
from app.publisher.outages import OutageParts, Outages
from app.publisher.sender import Sender, SenderParts
from app.publisher.session import Session
from app.publisher.settlement import (
    CloseCause,
    Quarantine,
    early_return_reason,
    early_returns,
    lose,
    settle,
)
from app.publisher.spans import batch_spans
from app.publisher.wakeup import Signal
from app.publisher.writeback import Writeback, WritebackParts
from app.settings import Settings

log = logging.getLogger("app.publisher")

EXCHANGE_OK_TTL = 60.0
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
        self.registry = PublisherRegistry(store.db)
        self.publisher_id = publisher_id or settings.publisher_id or default_publisher_id()
        self.metrics = metrics or PublisherMetrics()
        self.clock = clock
        self.backoff = Backoff(
            base=settings.backoff_base, cap=settings.backoff_max, rng=rng or random.Random()
        )
        self.limits = Limits(
            max_body_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes
        )
        self.holdings = Holdings()
        self.quarantine = Quarantine()
        self.destinations = Destinations(
            backoff=self.backoff,
            ok_ttl=EXCHANGE_OK_TTL,
            outage_max_wait=settings.destination_outage_max_wait,
        )
        self.db = DbThread(claims_apart=store.db.is_postgres, clock=clock)
        self.spans = batch_spans(enabled=settings.publisher_tracing, publisher_id=self.publisher_id)
        self.session = Session(
            settings=settings,
            metrics=self.metrics,
            events=self,
            name=f"outbox-publisher {self.publisher_id}",
            clock=clock,
            rng=self.backoff.rng,
        )
        self.writeback = Writeback(
            WritebackParts(
                settings=settings,
                store=store,
                db=self.db,
                owner=self.publisher_id,
                holdings=self.holdings,
                due_notes=self.session.due_notes,
                next_note_at=self.session.next_note_at,
                metrics=self.metrics,
                backoff=self.backoff,
                freed=self._freed,
                clock=clock,
                made_due=self._made_due,
                gone=lambda ids: self.outages.lost(ids),
                spans=self.spans,
            )
        )
        self.sender = Sender(
            SenderParts(
                holdings=self.holdings,
                session=self.session,
                destinations=self.destinations,
                quarantine=self.quarantine,
                metrics=self.metrics,
                outcomes=self.writeback.buffer,
                written=self.writeback.wake.set,
                wall_clock=store.db.clock,
                clock=clock,
                spans=self.spans,
            ),
            batch=settings.claim_batch,
            limits=self.limits,
        )
        self.outages = Outages(
            OutageParts(
                destinations=self.destinations,
                holdings=self.holdings,
                quarantine=self.quarantine,
                metrics=self.metrics,
                outcomes=self.writeback.buffer,
                written=self.writeback.wake.set,
                unpark=self.sender.unpark,
                clock=clock,
                reconnect=self.session.reconnect,
            ),
            burst=settings.destination_nack_burst,
            outage_after=settings.destination_outage_after,
        )
        self.claimer = Claimer(
            ClaimerParts(
                settings=settings,
                store=store,
                db=self.db,
                owner=self.publisher_id,
                holdings=self.holdings,
                session=self.session,
                metrics=self.metrics,
                accepted=self.sender.work.set,
                clock=clock,
                undoable=self.writeback.undoable,
                notified=lambda: self.listener.listening,
                settled=self.writeback.settled,
            )
        )
        self.listener = Listener(
            url=settings.database_url.get_secret_value(), wake=self.claimer.new_rows
        )
        self.housekeeping: Housekeeping | None = None
        self.probes: ProbeServer | None = None
        self.metrics.gauges = self._gauges
        self._stop = asyncio.Event()
        self._early_logged: float | None = None  # the connection whose early returns were logged
        self._settled = Signal()
        self._tasks: dict[str, asyncio.Task[Any]] = {}

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
        self.housekeeping = Housekeeping(
            HousekeepingParts(
                settings=self.settings,
                store=self.store,
                registry=self.registry,
                db=self.db,
                owner=self.publisher_id,
                holdings=self.holdings,
                session=self.session,
                metrics=self.metrics,
                report=self.report,
                idle=self._idle,
                request_stop=self.request_stop,
                clock=self.clock,
            ),
            until_empty=until_empty,
        )
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
        assert self.housekeeping is not None
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
            await self._settled.wait(min(left, 0.1))

    # ------------------------------------------------------------ session events (sync)

    def answered(self, events: list[Event]) -> None:
        """basic.ack / basic.nack settled publishes."""
        now = self.clock()
        self._observe_latency(events, now)
        m = self.metrics
        m.nacked += sum(len(e.row_ids) for e in events if isinstance(e, Nacked))
        events = self._hold_back_early_returns(events)
        tally = settle(self.outages.answered(events), self.writeback.out, self.quarantine)
        m.confirmed += tally.confirmed
        m.returned += tally.returned
        self.writeback.wake.set()
        if not self.session.outstanding():
            self._settled.set()
            self.sender.work.set()

    def lost(self, events: list[Event], cause: CloseCause) -> None:
        """A channel or the connection went away with publishes outstanding."""
        events = self._hold_back_early_returns(events)
        tally = lose(
            events,
            self.writeback.out,
            cause=cause,
            rows=self.holdings.held,
            quarantine=self.quarantine,
        )
        self.outages.lost([i for e in events if isinstance(e, Lost) for i in e.row_ids])
        m = self.metrics
        m.returned += tally.returned
        m.lost_confirms += tally.lost + len(tally.resent)
        m.failed += tally.oversized
        if tally.resent:
            self.holdings.bump_attempts(tally.resent)
        for row_id in tally.poison:
            m.poison += 1
            row = self.holdings.held.get(row_id)
            log.error(
                "row %d (message_id %r) fails as poison: the broker closed its channel or "
                "connection every time it was published alone",
                row_id,
                row.message_id if row else None,
            )
        if tally.paused is not None:
            self.sender.destination_failed(tally.paused, tally.paused_reason, [])
        if cause.max_size is not None:
            known = self.sender.broker_max_size
            if known is None or cause.max_size < known:
                log.warning(
                    "the broker refuses bodies over %d bytes (max_message_size): larger "
                    "rows fail with that reason",
                    cause.max_size,
                )
                self.sender.broker_max_size = cause.max_size
        self.writeback.wake.set()
        self._settled.set()
        self.sender.work.set()

    def _hold_back_early_returns(self, events: list[Event]) -> list[Event]:
        """``312 NO_ROUTE`` returns within ``return_grace`` of connecting: the rows go back to
        be published again after a backoff (per row, growing with its attempts), nothing spent;
        the other events are returned for settlement."""
        grace = self.settings.return_grace
        events, early = early_returns(events, in_grace=self.session.connection_age() < grace)
        if not early:
            return events
        out, held = self.writeback.out, self.holdings.held
        for event in early:
            row = held.get(event.row_id)
            delay = self.backoff.delay(row.attempts if row is not None else 1)
            out.postpone(early_return_reason(event, grace), delay, [event.row_id])
        self.quarantine.settled(e.row_id for e in early)
        self.outages.lost([e.row_id for e in early])
        self.metrics.returns_retried += len(early)
        connected_at = self.session.connected_at
        log_at = logging.WARNING if self._early_logged != connected_at else logging.DEBUG
        self._early_logged = connected_at
        log.log(
            log_at,
            "%d publishes returned %s within %.1fs of connecting (return_grace %gs): the broker "
            "may still be recovering its bindings; published again with backoff",
            len(early),
            f"{early[0].reply_code} {early[0].reply_text}",
            self.session.connection_age(),
            grace,
        )
        return events

    def connection_changed(self) -> None:
        self.sender.work.set()
        self.claimer.room.set()
        self._settled.set()

    def blocked_changed(self) -> None:
        if self.housekeeping is not None:
            self.housekeeping.beat_now.set()
        self.connection_changed()

    def _observe_latency(self, events: list[Event], now: float) -> None:
        """Confirmed rows, grouped by their publish write: one observation per group."""
        hist = self.metrics.confirm_latency
        for event in events:
            if not isinstance(event, Confirmed):
                continue
            last_at, run = -1.0, 0
            for facts in event.sent:
                at = facts[3]
                if at != last_at and run:
                    hist.observe_many(max(0.0, now - last_at), run)
                    run = 0
                last_at, run = at, run + 1
            if run:
                hist.observe_many(max(0.0, now - last_at), run)

    # ------------------------------------------------------------ small callbacks

    def _freed(self) -> None:
        self.claimer.room.set()
        self._settled.set()

    def _made_due(self) -> None:
        self.claimer.new_rows()

    def _idle(self) -> bool:
        h = self.holdings
        return not h.held and not h.queue and self.writeback.out.empty()

    # ------------------------------------------------------------ observability

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
