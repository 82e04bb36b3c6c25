"""Diagnostic: the broker's ceiling for this message shape, with no database in the way.

Publishes with the product's own wire layer (``app.amqp``: many publishes coalesced
into one socket write, acks handled as plain callbacks), a window of ``WINDOW`` unconfirmed
messages, in batches of ``BATCH``. The figure bounds any drain: the publisher cannot move rows
faster than the broker confirms them. Not one of the issue's keys: reported as ``diag_*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from app.amqp.codec import OutgoingMessage, ReturnedMessage
from app.amqp.codec import marshal_properties as marshal
from app.amqp.connection import AMQPConnection
from app.amqp.errors import CloseReason
from bench.common import BODY, Measured, Services, Sizes, rate, repeat, topology
from bench.proccpu import RunCpu, describe, median_by_process

WINDOW = 5_000
BATCH = 500


class _Acks:
    """Counts confirmed publishes (acks may be ``multiple``)."""

    def __init__(self) -> None:
        self.confirmed = 0
        self.nacked = 0
        self.changed = asyncio.Event()
        self.lost: CloseReason | None = None

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        self._settle(delivery_tag, multiple)

    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        self.nacked += 1
        self._settle(delivery_tag, multiple)

    def _settle(self, tag: int, multiple: bool) -> None:
        self.confirmed = max(self.confirmed, tag) if multiple else self.confirmed + 1
        self.changed.set()

    def on_return(self, channel_id: int, message: ReturnedMessage) -> None:
        pass

    def on_channel_closed(self, channel_id: int, reason: CloseReason) -> None:
        self.lost = reason
        self.changed.set()

    def on_blocked(self, reason: str) -> None:
        pass

    def on_unblocked(self) -> None:
        pass

    def on_connection_lost(self, reason: CloseReason) -> None:
        self.lost = reason
        self.changed.set()


async def _publish(services: Services, exchange: str, key: str, n: int) -> float:
    acks = _Acks()
    conn = await AMQPConnection.connect(services.amqp_url, listener=acks, name="bench-ceiling")
    try:
        channel = await conn.open_channel(confirm=True)
        start = time.perf_counter()
        sent = 0
        while acks.confirmed < n:
            if acks.lost is not None:
                raise RuntimeError(f"channel lost: {acks.lost}")
            room = min(WINDOW - (sent - acks.confirmed), n - sent)
            if room >= min(BATCH, n - sent) and room > 0:
                count = min(BATCH, room)
                msgs = [
                    OutgoingMessage(
                        exchange,
                        key,
                        BODY,
                        marshal({"delivery_mode": 2, "message_id": f"m-{sent + i}"}),
                    )
                    for i in range(count)
                ]
                conn.publish_batch(channel, msgs)
                sent += count
                await (conn.drain() if conn.write_paused else asyncio.sleep(0))
                continue
            acks.changed.clear()
            await acks.changed.wait()
        return time.perf_counter() - start
    finally:
        await conn.close()


def _once(services: Services, n: int, cpu: list[dict[str, float]]) -> float:
    with topology(services, "ceiling") as topo:
        with RunCpu("client", rabbitmq=services.broker_port) as used:
            seconds = asyncio.run(_publish(services, topo.exchange, topo.routing_key, n))
        cpu.append(used.per_message(n))
        depth = topo.depth()
    if depth != n:
        raise RuntimeError(f"ceiling: queue holds {depth} messages, published {n}")
    return rate(n, seconds)


def run(services: Services, sizes: Sizes) -> list[Measured]:
    """The ceiling, with the CPU per message of the wire-layer client and of the broker: what
    the drains' CPU per row is compared with (docs/performance.md, the capacity model)."""
    n = 2 * sizes.publish
    cpu: list[dict[str, float]] = []
    measured = repeat("diag_broker_ceiling_wire_only", "msg/s", lambda: _once(services, n, cpu))
    measured.extra["cpu_us_per_msg_by_process"] = cpu
    print(f"    CPU per message: {describe(median_by_process(cpu))}", flush=True)
    return [measured]


class _Timed(_Acks):
    """Acks with the time each delivery tag was confirmed (``multiple`` settles every tag up to
    it); publish times are noted by the publisher."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[float] = [0.0]  # index = delivery tag (tags start at 1)
        self.latencies: list[float] = []
        self._settled = 0

    def _settle(self, tag: int, multiple: bool) -> None:
        now = time.perf_counter()
        first = self._settled + 1 if multiple else tag
        for t in range(first, tag + 1):
            self.latencies.append(now - self.published[t])
        self._settled = max(self._settled, tag)
        super()._settle(tag, multiple)


async def paced(
    services: Services, exchange: str, key: str, rate_per_s: float, seconds: float
) -> list[float]:
    """Publish at ``rate_per_s`` (a batch every 20 ms, like the latency run's producer) for
    ``seconds``; the publish -> ack latency of every message, in seconds, in tag order."""
    acks = _Timed()
    conn = await AMQPConnection.connect(services.amqp_url, listener=acks, name="bench-floor")
    try:
        channel = await conn.open_channel(confirm=True)
        start = time.perf_counter()
        sent = 0
        while (elapsed := time.perf_counter() - start) < seconds:
            due = int(elapsed * rate_per_s) - sent
            if due > 0:
                props = [{"delivery_mode": 2, "message_id": f"f-{sent + i}"} for i in range(due)]
                msgs = [OutgoingMessage(exchange, key, BODY, marshal(p)) for p in props]
                now = time.perf_counter()
                acks.published.extend([now] * due)
                conn.publish_batch(channel, msgs)
                sent += due
                if conn.write_paused:
                    await conn.drain()
            await asyncio.sleep(0.02)
        deadline = time.perf_counter() + 30
        while acks.confirmed < sent and time.perf_counter() < deadline:
            if acks.lost is not None:
                raise RuntimeError(f"channel lost: {acks.lost}")
            acks.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acks.changed.wait(), 1.0)
        return acks.latencies
    finally:
        await conn.close()


def run_confirm_floor(
    services: Services, *, rate_per_s: float, seconds: float, warmup: float
) -> list[Measured]:
    """The broker's own confirm latency for this message shape at the latency run's rate, from
    the product's wire layer with no database: the floor under ``confirm_latency_*``."""
    with (
        topology(services, "floor") as topo,
        RunCpu("client", rabbitmq=services.broker_port) as used,
    ):
        lat = asyncio.run(
            paced(services, topo.exchange, topo.routing_key, rate_per_s, warmup + seconds)
        )
    cpu = used.per_message(max(1, len(lat)))
    steady = sorted(lat[int(rate_per_s * warmup) :]) or sorted(lat)
    p50 = steady[len(steady) // 2] * 1000
    p99 = steady[min(len(steady) - 1, int(len(steady) * 0.99))] * 1000
    print(
        f"  broker confirm latency (wire layer, no database) at {rate_per_s:,.0f} msg/s over "
        f"{len(steady):,} messages: p50 {p50:.1f} ms, p99 {p99:.1f} ms; CPU per message: "
        f"{describe(cpu)}",
        flush=True,
    )
    return [
        Measured(
            key="diag_broker_confirm_p50_ms",
            unit="ms",
            runs=[p50],
            extra={"rate_msg_per_s": rate_per_s, "cpu_us_per_msg_by_process": [cpu]},
        ),
        Measured(key="diag_broker_confirm_p99_ms", unit="ms", runs=[p99]),
    ]
