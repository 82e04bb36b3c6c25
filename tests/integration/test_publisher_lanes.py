"""Claims on their own database lane (PostgreSQL): a claim never waits for a write-back, yet a
row a running write-back releases is accepted by a later claim only after that write-back has
forgotten it; and once caught up, only news of rows brings a claim."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
from prometheus_client import generate_latest
from sqlalchemy import select

from app.db import make_engine
from app.outbox.schema import outbox
from app.outbox.store import PublisherStore
from app.publisher.engine import Publisher
from app.publisher.metrics import registry_for
from tests.support.factories import add_rows
from tests.support.publisher import all_in, running_publisher, settings_for, wait_rows

NO_BROKER = "amqp://guest:guest@127.0.0.1:9/"  # never dialled: these parts need no broker
SLOW_POLL = 5.0


async def _caught_up(publisher: Publisher) -> None:
    """Until the publisher listens and its start-up claims are over: it waits for news."""
    deadline = time.monotonic() + 10
    while not publisher.listener.listening and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)


async def test_a_claim_accepts_a_row_a_running_write_back_released_only_after_it(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The write-back (main lane) releases published rows (their confirms lost with a channel)
    and commits; before its call returns, a claim (claims lane) takes the same rows again. The
    claim must not be accepted before the write-back forgets the rows: accepted first, the new
    claim would be forgotten with the old one (held by nobody, leased to us). The wait is
    logged and shows in ``outbox_publisher_claim_wait_seconds``."""
    caplog.set_level(logging.INFO, logger="app.publisher")
    engine = make_engine(pg_url)
    settings = settings_for(db_url=pg_url, amqp_url=NO_BROKER)
    publisher = Publisher(settings=settings, store=PublisherStore(engine))
    assert publisher.db.claims_apart
    publisher.db.start()
    go_on = threading.Event()
    try:
        add_rows(engine, n=3)
        first = await publisher.claimer._claim(10)
        assert first is not None and len(first) == 3
        ids = [r.id for r in first]
        publisher.holdings.take(10)  # as if sent

        committed = threading.Event()
        real_write = publisher.writeback._write

        def write_then_stall(**kwargs: Any) -> Any:
            written = real_write(**kwargs)  # committed: the rows are pending again
            committed.set()
            go_on.wait(10)
            return written

        publisher.writeback._write = write_then_stall  # type: ignore[method-assign]
        publisher.writeback.buffer().lose("channel closed before the confirm came", ids)
        flush = asyncio.create_task(publisher.writeback.flush())
        assert await asyncio.to_thread(committed.wait, 10)

        claim = asyncio.create_task(publisher.claimer._claim(10))
        await asyncio.sleep(0.5)  # the claim's statement has long returned the rows
        owned = select(outbox.c.status, outbox.c.lease_owner).order_by(outbox.c.id)
        with engine.connect() as conn:
            owners = conn.execute(owned).all()
        assert owners == [("in_flight", publisher.publisher_id)] * 3
        assert not claim.done(), "a claim was accepted while the write-back settling its rows ran"

        go_on.set()
        assert await flush
        again = await claim
        assert again is not None and [r.id for r in again] == ids
        assert sorted(publisher.holdings.held) == ids  # held again, as the database says
        assert [r.id for r in publisher.holdings.queue] == ids

        waits = publisher.metrics.claim_wait_seconds
        assert waits.count == 1 and waits.sum >= 0.4  # it waited out the stalled write-back
        scraped = generate_latest(registry_for(publisher.metrics, publisher_id="p")).decode()
        assert 'outbox_publisher_claim_wait_seconds_count{publisher="p"} 1.0' in scraped
        said = [
            r.getMessage() for r in caplog.records if "write-back was settling" in r.getMessage()
        ]
        assert len(said) == 1 and said[0].startswith("a claim returned 3 row(s)"), said
    finally:
        go_on.set()
        publisher.db.stop()
        engine.dispose()


async def test_caught_up_a_claim_follows_news_of_rows_not_every_write_back(
    pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    """With notifications up, a burst of rows costs one claim: the write-backs that confirm it
    free room in the window, but the outbox had nothing more, so they bring no (empty) claim."""
    engine = make_engine(pg_url)
    try:
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, poll_interval=SLOW_POLL)
        async with running_publisher(settings, engine) as publisher:
            await _caught_up(publisher)
            before = publisher.metrics.claim_seconds.count
            bursts = 5
            for _ in range(bursts):
                add_rows(engine, n=20, exchange=topology["exchange"])
                await wait_rows(engine, all_in("confirmed"), timeout=10)
            claims = publisher.metrics.claim_seconds.count - before
        assert publisher.metrics.confirmed == 20 * bursts
        assert bursts <= claims <= bursts + 2, f"{claims} claims for {bursts} bursts"
    finally:
        engine.dispose()


async def test_an_ordered_key_moves_on_at_its_write_back_not_at_the_next_poll(
    pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    """A key's next row becomes due when the write-back settles its head, and no notification
    says so: that write-back is the claimer's news, or each row would wait for a poll."""
    engine = make_engine(pg_url)
    try:
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, poll_interval=SLOW_POLL)
        async with running_publisher(settings, engine) as publisher:
            await _caught_up(publisher)
            began = time.monotonic()
            add_rows(engine, n=10, exchange=topology["exchange"], ordering_key="one-key")
            await wait_rows(engine, all_in("confirmed"), timeout=4 * SLOW_POLL)
            took = time.monotonic() - began
        assert took < SLOW_POLL, f"{took:.1f}s for 10 rows of one key: they waited for polls"
    finally:
        engine.dispose()
