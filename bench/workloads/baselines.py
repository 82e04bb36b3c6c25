"""What users write instead of the product: bare publishing loops with publisher confirms.

Each run publishes persistent 256-byte messages (``mandatory``, a ``message_id`` each, like the
product) to its own durable exchange and classic queue, and is timed from the first publish to the
last confirm (connecting is not timed).
"""

from __future__ import annotations

import asyncio
import time

import aio_pika
import pika

from bench.common import BODY, Measured, Services, Sizes, rate, repeat, topology
from bench.proccpu import RunCpu, describe, median_by_process

WINDOW = 1_000


def _message(i: int) -> aio_pika.Message:
    return aio_pika.Message(
        BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=f"m-{i}"
    )


async def _aio_pika_each(services: Services, exchange: str, key: str, n: int) -> float:
    conn = await aio_pika.connect(services.amqp_url)
    try:
        channel = await conn.channel(publisher_confirms=True)
        ex = await channel.get_exchange(exchange)
        start = time.perf_counter()
        for i in range(n):
            await ex.publish(_message(i), routing_key=key, mandatory=True)
        return time.perf_counter() - start
    finally:
        await conn.close()


async def _aio_pika_window(services: Services, exchange: str, key: str, n: int) -> float:
    conn = await aio_pika.connect(services.amqp_url)
    try:
        channel = await conn.channel(publisher_confirms=True)
        ex = await channel.get_exchange(exchange)
        slots = asyncio.Semaphore(WINDOW)
        pending: set[asyncio.Task[object]] = set()

        async def one(i: int) -> None:
            try:
                await ex.publish(_message(i), routing_key=key, mandatory=True)
            finally:
                slots.release()

        start = time.perf_counter()
        for i in range(n):
            await slots.acquire()
            task = asyncio.create_task(one(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
        return time.perf_counter() - start
    finally:
        await conn.close()


def _pika_blocking(services: Services, exchange: str, key: str, n: int) -> float:
    conn = pika.BlockingConnection(pika.URLParameters(services.amqp_url))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        start = time.perf_counter()
        for i in range(n):
            props = pika.BasicProperties(delivery_mode=2, message_id=f"m-{i}")
            channel.basic_publish(exchange, key, BODY, properties=props, mandatory=True)
        return time.perf_counter() - start
    finally:
        conn.close()


def _checked(
    services: Services, tag: str, n: int, publish: object, cpu: list[dict[str, float]] | None = None
) -> float:
    """One run on a fresh exchange and queue; check every message arrived; return msg/s.
    ``cpu``: gets the run's CPU microseconds per message of this process (``client``: the loop
    runs here and nothing else does meanwhile; connecting included) and of the broker."""
    with topology(services, tag) as topo:
        with RunCpu("client", rabbitmq=services.broker_port) as used:
            if asyncio.iscoroutinefunction(publish):
                seconds = asyncio.run(publish(services, topo.exchange, topo.routing_key, n))
            else:
                seconds = publish(services, topo.exchange, topo.routing_key, n)  # type: ignore[operator]
        if cpu is not None:
            cpu.append(used.per_message(n))
        depth = topo.depth()
    if depth != n:
        raise RuntimeError(f"{tag}: queue holds {depth} messages, published {n}")
    return rate(n, seconds)


def _with_cpu(key: str, n: int, tag: str, services: Services, publish: object) -> Measured:
    cpu: list[dict[str, float]] = []
    measured = repeat(key, "msg/s", lambda: _checked(services, tag, n, publish, cpu))
    measured.extra["cpu_us_per_msg"] = [run["client"] for run in cpu]
    measured.extra["cpu_us_per_msg_by_process"] = cpu
    print(f"    CPU per message: {describe(median_by_process(cpu))}", flush=True)
    return measured


def run(services: Services, sizes: Sizes) -> list[Measured]:
    each = sizes.publish_each
    return [
        _with_cpu("publish_aio_pika_each", each, "each", services, _aio_pika_each),
        _with_cpu("publish_aio_pika_window", sizes.publish, "window", services, _aio_pika_window),
        _with_cpu("publish_pika_blocking", each, "pika", services, _pika_blocking),
    ]
