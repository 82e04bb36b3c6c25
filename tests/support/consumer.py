"""The consumer kit's tests' parts: handlers writing one row per message in ``consumer_effects``
(no unique key, so a second effect would show) in the kit's transaction, and queues, publishes
and waits on the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aio_pika
from sqlalchemy import Connection, Engine, text

from app.consumer import Consumer, ConsumerConfig, Message

EFFECTS = """CREATE TABLE IF NOT EXISTS consumer_effects (
    n SERIAL PRIMARY KEY, message_id TEXT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now())"""


INSERT = text("INSERT INTO consumer_effects (message_id) VALUES (:m)")


def create_effects(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS))


def record(message: Message, conn: Connection) -> None:
    """The effect: a row. Header ``poison`` makes it raise; ``sleep_ms`` slows it."""
    if message.headers.get("poison"):
        raise ValueError(f"cannot process {message.message_id}")
    pause = message.headers.get("sleep_ms")
    if isinstance(pause, int) and pause > 0:
        time.sleep(pause / 1000)
    conn.execute(
        text("INSERT INTO consumer_effects (message_id) VALUES (:m)"), {"m": message.message_id}
    )


def effects(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT message_id FROM consumer_effects")).scalars())


def crash_or_record(message: Message, conn: Connection) -> None:
    """:func:`record`, but header ``crash`` kills the process (as a segfault or an OOM kill
    would): nothing after the handler runs, no exception reaches the kit."""
    if message.headers.get("crash"):
        os._exit(137)
    record(message, conn)


def record_all(messages: Sequence[Message], conn: Connection) -> None:
    """A batch handler: the window's effects in one ``executemany``; any ``poison`` fails it."""
    for message in messages:
        if message.headers.get("poison"):
            raise ValueError(f"cannot process {message.message_id}")
    conn.execute(INSERT, [{"m": m.message_id} for m in messages])


@contextlib.asynccontextmanager
async def declared_queue(
    amqp_url: str,
    *,
    prefix: str,
    quorum: bool = False,
) -> AsyncIterator[str]:
    """A durable queue dead-lettering into ``<name>.dlq`` (a quorum queue with ``quorum``, with
    no x-delivery-limit: docs/consumer.md); both deleted afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        await ch.declare_queue(f"{name}.dlq", durable=True)
        args: dict[str, Any] = {
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": f"{name}.dlq",
        }
        if quorum:
            args["x-queue-type"] = "quorum"
        await ch.declare_queue(name, durable=True, arguments=args)
    try:
        yield name
    finally:
        conn = await aio_pika.connect(amqp_url)
        async with conn:
            for q in (name, f"{name}.dlq"):
                ch = await conn.channel()
                with contextlib.suppress(Exception):
                    await ch.queue_delete(q)


async def publish(amqp_url: str, queue: str, ids: list[str], **headers: Any) -> None:
    """Persistent messages with these ids (and headers), confirmed, by the default exchange."""
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        for mid in ids:
            await ch.default_exchange.publish(
                aio_pika.Message(
                    mid.encode(),
                    message_id=mid,
                    headers=headers,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=queue,
            )


async def until(predicate: Any, *, timeout: float = 60.0, what: str = "condition") -> None:
    """Wait for ``predicate()`` (run in a thread: it may query the database)."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_consumer(
    amqp_url: str, engine: Engine, config: ConsumerConfig, **handler: Any
) -> AsyncIterator[Consumer]:
    """A consumer kit running in a task (``handler=`` or ``batch_handler=``); stopped on exit,
    and failing the test if it does not stop within 30 s."""
    consumer = Consumer(config=config, amqp_url=amqp_url, engine=engine, **handler)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        yield consumer
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
