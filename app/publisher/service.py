"""The publisher as a service: ``run_publisher`` builds its engine and store from the
settings and publishes until stopped (the CLI, the demo and the benchmark call it); ``main`` runs
it with SIGTERM/SIGINT mapped to a graceful stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from sqlalchemy import Engine

from app.db import SchemaMismatch, check_schema, make_engine, session_limits
from app.outbox.ranged import RangedPublisherStore
from app.outbox.store import PublisherStore
from app.publisher.engine import Publisher
from app.publisher.metrics import PublisherMetrics, PublisherStats
from app.settings import Settings
from app.streams.relay import StreamRelay
from app.streams.store import StreamStore

log = logging.getLogger(__name__)


async def run_publisher(
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    until_empty: bool = False,
    metrics: PublisherMetrics | None = None,
) -> PublisherStats:
    """Publish until ``stop`` is set, or with ``until_empty`` until no pending/in_flight row is
    left. Builds its own engine and store from ``settings``."""
    # One DB thread reuses one pooled connection all the time: a pre-ping per checkout would add
    # a round trip to every statement; a dead connection fails the call, which is retried.
    # A frozen publisher must cost only its own rows, for its lease: its sessions end when they
    # sit in a transaction for a third of the lease (a keyed claim's head rows, a retry's
    # FOR UPDATE), so the others' keys and the sweep move on within one lease.
    url = settings.database_url.get_secret_value()
    extra = {}
    if url.startswith("postgresql"):
        args = session_limits(idle_in_transaction=settings.lease_seconds / 3)
        # pg_stat_activity names the process: an operator (or a test) finds a frozen one
        args["application_name"] = f"outbox-publisher pid {os.getpid()}"
        extra = {"connect_args": args}
    engine = make_engine(url, pool_pre_ping=False, **extra)
    try:
        await asyncio.to_thread(check_schema, engine)  # never publish on a schema we don't know
        store = await asyncio.to_thread(settling_store, engine, settings)
        publisher = Publisher(settings=settings, store=store, metrics=metrics)
        if isinstance(store, RangedPublisherStore):
            log.info("settling by ranges (OUTBOX_SETTLEMENT=ranges; docs/ranges-build.md)")
        # rows for streams go out through their lanes, beside the exchanges (app/streams)
        relay = StreamRelay(
            settings=settings, store=StreamStore(engine), owner=publisher.publisher_id
        )
        publisher.metrics.streams = relay.stats  # outbox_publisher_stream_* on /metrics
        relay_stop = asyncio.Event()
        relay_task = asyncio.create_task(relay.run(relay_stop), name="outbox-streams")
        try:
            return await publisher.run(stop=stop, until_empty=until_empty)
        finally:
            relay_stop.set()
            await relay_task
    finally:
        engine.dispose()


def settling_store(engine: Engine, settings: Settings) -> PublisherStore:
    """The store for ``OUTBOX_SETTLEMENT``. Settling rows on an outbox that has ranges would
    publish their members again (their rows still read ``pending``): refused, naming the fix."""
    if settings.settlement == "ranges":
        return RangedPublisherStore(engine)
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            ranged = conn.exec_driver_sql("SELECT 1 FROM outbox_ranges LIMIT 1").first()
        if ranged is not None:
            raise SchemaMismatch(
                "this outbox is settled by ranges (outbox_ranges has rows): run every "
                "publisher with OUTBOX_SETTLEMENT=ranges; settling rows would publish a range's "
                "members again"
            )
    return PublisherStore(engine)


def main(settings: Settings, *, until_empty: bool = False) -> PublisherStats:
    """Run the publisher in this thread; SIGTERM or SIGINT stop it gracefully."""

    async def _main() -> PublisherStats:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            return await run_publisher(settings, stop=stop, until_empty=until_empty)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    return asyncio.run(_main())
