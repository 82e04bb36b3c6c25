"""The receiving end: the consumer kit against the plain ways of consuming the same backlog.

Every consumer that has an effect writes one row per message (``bench_effects``) with the inbox
row in the same transaction, on the same PostgreSQL:

- ``consume_aio_pika_autoack`` and ``consume_aio_pika_manual_ack``: aio-pika's consume loop with
  no database at all (nothing deduplicated, no effect): the floor of the wire;
- ``consume_inbox_loop_per_message``: what a careful team writes by hand: aio-pika with prefetch
  100, and per message BEGIN, the inbox ``INSERT … ON CONFLICT DO NOTHING``, the effect, COMMIT,
  then the ack (psycopg's async connection, one message at a time);
- ``consume_kit_batched_*``: the kit in its default mode (windows of deliveries per transaction);
- ``consume_kit_per_message_*``: the kit with a transaction per message (``mode="message"``);
- ``consume_kit_batched_no_effect``: the kit's own work alone (a handler that does nothing);
- ``consume_kit_batch_handler``: a batch handler writing a window's effects in one
  ``executemany``.

Each run fills a fresh queue with ``n`` persistent messages, then times the consumer from its
start to the last message acknowledged. CPU per message is counted for the client process, the
broker and the database (``bench.proccpu``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import aio_pika
import psycopg
from sqlalchemy import Connection, text

from app.consumer import Consumer, ConsumerConfig, Message, consumer_engine
from bench.common import BODY, Measured, Services, Sizes, libpq_url, repeat, temp_postgres, topology
from bench.proccpu import RunCpu, describe, median_by_process

EFFECTS = "CREATE TABLE IF NOT EXISTS bench_effects (message_id TEXT NOT NULL, body BYTEA)"
#: built once, as a handler should (a ``text()`` per call parses its SQL every time: about
#: 30 us per message here)
INSERT_EFFECT = text("INSERT INTO bench_effects (message_id, body) VALUES (:m, :b)")


async def _fill(services: Services, queue: str, n: int) -> None:
    conn = await aio_pika.connect(services.amqp_url)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        pending = []
        for i in range(n):
            msg = aio_pika.Message(
                BODY, message_id=f"c-{i}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT
            )
            pending.append(ch.default_exchange.publish(msg, routing_key=queue))
            if len(pending) >= 1000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)


async def _plain(services: Services, queue: str, n: int, *, no_ack: bool) -> float:
    conn = await aio_pika.connect(services.amqp_url)
    async with conn:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=100)
        q = await ch.get_queue(queue)
        done = asyncio.Event()
        count = 0

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal count
            if not no_ack:
                await message.ack()
            count += 1
            if count >= n:
                done.set()

        start = time.perf_counter()
        await q.consume(on_message, no_ack=no_ack)
        await asyncio.wait_for(done.wait(), 600)
        return time.perf_counter() - start


async def _inbox_loop(services: Services, url: str, queue: str, n: int) -> float:
    """The hand-written per-message inbox loop."""
    db = await psycopg.AsyncConnection.connect(libpq_url(url))
    conn = await aio_pika.connect(services.amqp_url)
    async with conn, db:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=100)
        q = await ch.get_queue(queue)
        inbox: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        start = time.perf_counter()
        await q.consume(inbox.put, no_ack=False)
        for _ in range(n):
            message = await asyncio.wait_for(inbox.get(), 600)
            async with db.transaction():
                new = await db.execute(
                    "INSERT INTO outbox_inbox (consumer, message_id, received_at) "
                    "VALUES ('hand', %s, now()) ON CONFLICT DO NOTHING RETURNING message_id",
                    (message.message_id,),
                )
                if await new.fetchone() is not None:
                    await db.execute(
                        "INSERT INTO bench_effects (message_id, body) VALUES (%s, %s)",
                        (message.message_id, message.body),
                    )
            await message.ack()
        return time.perf_counter() - start


async def _kit(
    services: Services,
    url: str,
    queue: str,
    n: int,
    *,
    mode: str,
    prefetch: int,
    concurrency: int,
    handler_ms: float = 0.0,
    batches: bool = False,
    effect: bool = True,
) -> float:
    engine = consumer_engine(url, concurrency=concurrency)  # as `outbox consume` makes it

    def handler(message: Message, conn: Connection) -> None:
        if handler_ms:
            time.sleep(handler_ms / 1000)
        if effect:
            conn.execute(INSERT_EFFECT, {"m": message.message_id, "b": message.body})

    def batch_handler(messages: Sequence[Message], conn: Connection) -> None:
        conn.execute(INSERT_EFFECT, [{"m": m.message_id, "b": m.body} for m in messages])

    cfg = ConsumerConfig(
        name=f"bench-{queue}",
        queue=queue,
        prefetch=prefetch,
        mode=mode,  # type: ignore[arg-type]
        concurrency=concurrency,
    )
    given: dict[str, Any] = {"batch_handler": batch_handler} if batches else {"handler": handler}
    consumer = Consumer(config=cfg, amqp_url=services.amqp_url, engine=engine, **given)
    stop = asyncio.Event()
    start = time.perf_counter()
    task = asyncio.create_task(consumer.run(stop))
    try:
        while consumer.metrics.counts["acked"] < n:
            if task.done():
                task.result()
            await asyncio.sleep(0.002)
        return time.perf_counter() - start
    finally:
        stop.set()
        await task
        engine.dispose()


def _measure(
    services: Services, key: str, n: int, consume: Callable[[str], Any], *, database: bool
) -> Measured:
    cpu: list[dict[str, float]] = []
    ports = {"rabbitmq": services.broker_port}
    if database:
        ports["postgresql"] = services.database_port

    def one() -> float:
        with topology(services, key) as topo:
            asyncio.run(_fill(services, topo.queue, n))
            with RunCpu("client", **ports) as used:
                seconds = asyncio.run(consume(topo.queue))
            cpu.append(used.per_message(n))
        return n / seconds

    measured = repeat(key, "msg/s", one)
    measured.extra["cpu_us_per_msg"] = [run["client"] for run in cpu]
    measured.extra["cpu_us_per_msg_by_process"] = cpu
    print(f"    CPU per message: {describe(median_by_process(cpu))}", flush=True)
    return measured


def run(services: Services, sizes: Sizes) -> list[Measured]:
    n = max(2000, sizes.publish // 4)
    out = [
        _measure(
            services,
            "consume_aio_pika_autoack",
            n,
            lambda q: _plain(services, q, n, no_ack=True),
            database=False,
        ),
        _measure(
            services,
            "consume_aio_pika_manual_ack",
            n,
            lambda q: _plain(services, q, n, no_ack=False),
            database=False,
        ),
    ]
    with temp_postgres(services) as url:
        with psycopg.connect(libpq_url(url), autocommit=True) as db:
            db.execute(EFFECTS)
        out.append(
            _measure(
                services,
                "consume_inbox_loop_per_message",
                n,
                lambda q: _inbox_loop(services, url, q, n),
                database=True,
            )
        )
        defaults = ConsumerConfig(name="-", queue="-")  # what `outbox consume` runs
        base = {"prefetch": defaults.prefetch, "concurrency": defaults.concurrency}
        kits: list[tuple[str, dict[str, Any]]] = [
            ("consume_kit_batched", {**base, "mode": "batch"}),
            # the floor under it: the kit's own work, a handler that does nothing
            ("consume_kit_batched_no_effect", {**base, "mode": "batch", "effect": False}),
            # the lever: the window's effects in one executemany (a batch handler)
            ("consume_kit_batch_handler", {**base, "mode": "batch", "batches": True}),
            ("consume_kit_per_message", {**base, "mode": "message"}),
            ("consume_kit_batched_handler_5ms", {**base, "mode": "batch", "handler_ms": 5}),
            ("consume_kit_per_message_handler_5ms", {**base, "mode": "message", "handler_ms": 5}),
        ]
        for key, options in kits:
            out.append(
                _measure(
                    services,
                    key,
                    n,
                    lambda q, o=options: _kit(services, url, q, n, **o),
                    database=True,
                )
            )
    return out
