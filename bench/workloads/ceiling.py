"""Diagnostic: the broker's ceiling for this message shape, with no database in the way.

Publishes with the product's own wire layer (``app.amqp``: many publishes coalesced
into one socket write, acks handled as plain callbacks), a window of ``WINDOW`` unconfirmed
messages, in batches of ``BATCH``. The figure bounds any drain: the publisher cannot move rows
faster than the broker confirms them. Not one of the issue's keys: reported as ``diag_*``.
"""

from __future__ import annotations

import asyncio
import time

from app.amqp import AMQPConnection, CloseReason, OutgoingMessage, ReturnedMessage
from app.amqp import marshal_properties as marshal
from bench.common import BODY, Measured, Services, Sizes, rate, repeat, topology

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


def _once(services: Services, n: int) -> float:
    with topology(services, "ceiling") as topo:
        seconds = asyncio.run(_publish(services, topo.exchange, topo.routing_key, n))
        depth = topo.depth()
    if depth != n:
        raise RuntimeError(f"ceiling: queue holds {depth} messages, published {n}")
    return rate(n, seconds)


def run(services: Services, sizes: Sizes) -> list[Measured]:
    n = 2 * sizes.publish
    return [repeat("diag_broker_ceiling_wire_only", "msg/s", lambda: _once(services, n))]
