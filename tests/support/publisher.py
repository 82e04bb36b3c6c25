"""Helpers for the publisher tests: settings, a background publisher, DB polling, consumers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
from sqlalchemy import Engine, select

from app.outbox.schema import outbox
from app.outbox.store import PublisherStore
from app.publisher.engine import Publisher
from app.publisher.metrics import PublisherStats
from app.settings import Settings

FAST = {
    "poll_interval": 0.05,
    "flush_interval": 0.01,
    "backoff_base": 0.05,
    "backoff_max": 0.4,
    "heartbeat": 0,
    "lease_seconds": 30.0,
    "shutdown_timeout": 3.0,
    "reconnect_max_delay": 0.5,
    "confirm_timeout": 30.0,
    "publisher_metrics_port": 0,
    # returns right after connecting end rows here at once; the grace has tests of its own
    "return_grace": 0.0,
}


def settings_for(*, db_url: str, amqp_url: str, **overrides: Any) -> Settings:
    return Settings(database_url=db_url, amqp_url=amqp_url, **{**FAST, **overrides})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Row:
    id: int
    message_id: str
    exchange: str
    status: str
    attempts: int
    nacks: int
    lost_confirms: int
    last_error: str | None
    reply_code: int | None
    reply_text: str | None
    channel_id: int | None
    delivery_tag: int | None
    published_at: dt.datetime | None
    confirmed_at: dt.datetime | None


def rows(engine: Engine) -> list[Row]:
    cols = [outbox.c[name] for name in Row.__dataclass_fields__]
    with engine.connect() as conn:
        return [Row(**r._asdict()) for r in conn.execute(select(*cols).order_by(outbox.c.id))]


def statuses(engine: Engine) -> collections.Counter[str]:
    return collections.Counter(r.status for r in rows(engine))


async def wait_rows(
    engine: Engine, predicate: Callable[[list[Row]], bool], *, timeout: float = 30.0
) -> list[Row]:
    """Poll the outbox (off the loop) until ``predicate(rows)`` holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        current = await asyncio.to_thread(rows, engine)
        if predicate(current):
            return current
        if time.monotonic() > deadline:
            summary = collections.Counter(r.status for r in current)
            raise AssertionError(f"rows never reached the expected state: {dict(summary)}")
        await asyncio.sleep(0.05)


def all_in(*states: str) -> Callable[[list[Row]], bool]:
    return lambda rs: bool(rs) and all(r.status in states for r in rs)


@contextlib.asynccontextmanager
async def running_publisher(
    settings: Settings, engine: Engine, *, store: PublisherStore | None = None, **kwargs: Any
) -> AsyncIterator[Publisher]:
    """A Publisher running in a task (on ``store``, else the real one on ``engine``); stopped
    gracefully (bounded) on exit."""
    publisher = Publisher(settings=settings, store=store or PublisherStore(engine), **kwargs)
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop=stop))
    try:
        yield publisher
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task


async def run_until_empty(settings: Settings, engine: Engine) -> PublisherStats:
    publisher = Publisher(settings=settings, store=PublisherStore(engine))
    async with asyncio.timeout(120):
        return await publisher.run(until_empty=True)


# ---------------------------------------------------------------- real broker


async def declare(
    amqp_url: str,
    *,
    exchange: str | None = None,
    queue: str | None = None,
    arguments: dict[str, Any] | None = None,
    routing_key: str = "rk",
) -> None:
    """Declare a durable exchange (direct) and/or queue, bound with ``routing_key``."""
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        ex = None
        if exchange:
            ex = await ch.declare_exchange(exchange, aio_pika.ExchangeType.DIRECT, durable=True)
        if queue:
            q = await ch.declare_queue(queue, durable=True, arguments=arguments)
            if ex is not None:
                await q.bind(ex, routing_key)


async def delete(
    amqp_url: str, *, exchanges: tuple[str, ...] = (), queues: tuple[str, ...] = ()
) -> None:
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        for name in queues:
            ch = await conn.channel()
            with contextlib.suppress(Exception):
                await ch.queue_delete(name)
        for name in exchanges:
            ch = await conn.channel()
            with contextlib.suppress(Exception):
                await ch.exchange_delete(name)


async def consume_ids(
    amqp_url: str, queue: str, *, expect: int, idle: float = 1.0, timeout: float = 60.0
) -> collections.Counter[str]:
    """Consume ``queue`` (auto-ack) until ``expect`` messages came and then ``idle`` seconds
    passed without another; return how many times each message_id arrived."""
    seen: collections.Counter[str] = collections.Counter()
    last = time.monotonic()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal last
        seen[message.message_id or ""] += 1
        last = time.monotonic()

    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=2000)
        q = await ch.get_queue(queue, ensure=False)
        tag = await q.consume(on_message, no_ack=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if seen.total() >= expect and time.monotonic() - last >= idle:
                break
            await asyncio.sleep(0.05)
        await q.cancel(tag)
    return seen
