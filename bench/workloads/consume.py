"""The receiving end: the consumer kit (inbox in PostgreSQL, manual acks) at prefetch 1, 10, 100
and 1,000, with ``multiple`` and with single acks, with a handler of 0 and of 5 ms, next to
aio-pika's plain consume loops (auto-ack, and a manual ack per message) on the same backlog.

Each run fills a fresh queue with ``n`` persistent messages, then times the consumer from its
start to the last message handled (acks flushed). CPU per message is this process's CPU time
(the kit's event loop and handler threads, or aio-pika's loop) over the messages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aio_pika
from sqlalchemy import Connection

from app.consumer import Consumer, ConsumerConfig, Message, consumer_engine
from bench.common import BODY, Measured, Services, Sizes, repeat, temp_postgres, topology
from bench.proccpu import RunCpu, describe, median_by_process


async def _fill(services: Services, queue: str, n: int) -> None:
    conn = await aio_pika.connect(services.amqp_url)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        pending = []
        for i in range(n):
            msg = aio_pika.Message(BODY, message_id=f"c-{i}",
                                   delivery_mode=aio_pika.DeliveryMode.PERSISTENT)  # fmt: skip
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


async def _kit(services: Services, url: str, queue: str, n: int, *, prefetch: int,
               multiple: bool, handler_ms: float) -> float:  # fmt: skip
    concurrency = min(8, prefetch)
    engine = consumer_engine(url, concurrency=concurrency)  # as `outbox consume` makes it

    def handler(message: Message, conn: Connection) -> None:
        if handler_ms:
            time.sleep(handler_ms / 1000)

    cfg = ConsumerConfig(name=f"bench-{queue}", queue=queue, prefetch=prefetch,
                         concurrency=concurrency, ack_multiple=multiple)  # fmt: skip
    consumer = Consumer(config=cfg, amqp_url=services.amqp_url, engine=engine, handler=handler)
    stop = asyncio.Event()
    start = time.perf_counter()
    task = asyncio.create_task(consumer.run(stop))
    try:
        while consumer.metrics.counts["acked"] < n:
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
        return time.perf_counter() - start
    finally:
        stop.set()
        await task
        engine.dispose()


def _measure(services: Services, key: str, n: int, consume: Callable[[str], Any]) -> Measured:
    cpu: list[dict[str, float]] = []
    ports = {"rabbitmq": services.broker_port}
    if key.startswith("consume_kit"):  # the inbox's database
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
    n = max(1000, sizes.publish // 10)
    out = [
        _measure(services, "consume_aio_pika_autoack", n,
                 lambda q: _plain(services, q, n, no_ack=True)),
        _measure(services, "consume_aio_pika_manual_ack", n,
                 lambda q: _plain(services, q, n, no_ack=False)),
    ]  # fmt: skip
    with temp_postgres(services) as url:
        for prefetch in (1, 10, 100, 1000):
            out.append(_measure(
                services, f"consume_kit_prefetch_{prefetch}", n,
                lambda q, p=prefetch: _kit(services, url, q, n, prefetch=p, multiple=True,
                                           handler_ms=0),
            ))  # fmt: skip
        out.append(_measure(
            services, "consume_kit_prefetch_100_single_acks", n,
            lambda q: _kit(services, url, q, n, prefetch=100, multiple=False, handler_ms=0),
        ))  # fmt: skip
        for prefetch in (10, 100):
            out.append(_measure(
                services, f"consume_kit_prefetch_{prefetch}_handler_5ms", n,
                lambda q, p=prefetch: _kit(services, url, q, n, prefetch=p, multiple=True,
                                           handler_ms=5),
            ))  # fmt: skip
    return out
