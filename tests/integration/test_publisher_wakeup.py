"""New rows reach the publisher without waiting for a poll: PostgreSQL LISTEN/NOTIFY, with
polling as the fallback when the notification never comes."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import Engine, text

from app.db import make_engine
from tests.factories import add_rows
from tests.publisher_support import all_in, rows, running_publisher, settings_for, wait_rows

SLOW_POLL = 5.0  # a poll this slow cannot explain a claim within a second


async def _time_to_confirm(engine: Engine, settings: object, exchange: str) -> float:
    async with running_publisher(settings, engine) as publisher:  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while not publisher.listener.listening and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(SLOW_POLL + 0.5)  # the startup claims are over: the claimer idles
        began = time.monotonic()
        add_rows(engine, n=5, exchange=exchange)
        await wait_rows(engine, all_in("confirmed"), timeout=30)
        return time.monotonic() - began


async def test_a_committed_row_is_claimed_at_once_not_at_the_next_poll(
    pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    engine = make_engine(pg_url)
    try:
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, poll_interval=SLOW_POLL)
        took = await _time_to_confirm(engine, settings, topology["exchange"])
        assert took < 1.0, f"{took:.2f}s: the notification did not wake the claimer"
    finally:
        engine.dispose()


async def test_without_notifications_the_poll_still_finds_the_rows(
    pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    """The trigger gone (or the notification lost): rows are still claimed, at the next poll."""
    engine = make_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER outbox_notify_new ON outbox"))
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, poll_interval=SLOW_POLL)
        took = await _time_to_confirm(engine, settings, topology["exchange"])
        assert 1.0 < took < SLOW_POLL + 3, f"{took:.2f}s"
        assert len(rows(engine)) == 5
    finally:
        engine.dispose()
