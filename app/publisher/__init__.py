"""The publisher service (``outbox publish``): drains the outbox into RabbitMQ with confirms.

``run_publisher`` is the async entry point (the CLI, the demo and the benchmark use it); ``main``
runs it with SIGTERM/SIGINT mapped to a graceful stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from app.db import check_schema, make_engine
from app.outbox.repository import OutboxRepository
from app.publisher.engine import Publisher
from app.publisher.metrics import PublisherMetrics, PublisherStats
from app.settings import Settings

__all__ = ["Publisher", "PublisherMetrics", "PublisherStats", "main", "run_publisher"]

log = logging.getLogger(__name__)


async def run_publisher(
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    until_empty: bool = False,
    metrics: PublisherMetrics | None = None,
) -> PublisherStats:
    """Publish until ``stop`` is set, or with ``until_empty`` until no pending/in_flight row is
    left. Builds its own engine and repository from ``settings``."""
    # One DB thread reuses one pooled connection all the time: a pre-ping per checkout would add
    # a round trip to every statement; a dead connection fails the call, which is retried.
    engine = make_engine(settings.database_url.get_secret_value(), pool_pre_ping=False)
    try:
        await asyncio.to_thread(check_schema, engine)  # never publish on a schema we don't know
        publisher = Publisher(settings=settings, repository=OutboxRepository(engine),
                              metrics=metrics)  # fmt: skip
        return await publisher.run(stop=stop, until_empty=until_empty)
    finally:
        engine.dispose()


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
