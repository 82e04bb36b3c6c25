"""RabbitMQ streams for tests: create one of the test's own, read it whole from its first
offset (what every exactly-once check counts), delete it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from dataclasses import dataclass

from rstream.amqp import amqp_decoder
from rstream.client import Client
from rstream.constants import ConsumerOffsetSpecification, OffsetType
from rstream.consumer import Consumer

from app.streams.endpoint import StreamEndpoint


async def _client(url: str) -> Client:
    ep = StreamEndpoint.parse(url)
    client = Client(host=ep.host, port=ep.port, frame_max=1024 * 1024, heartbeat=60)
    await client.start()
    await client.authenticate(vhost=ep.vhost, username=ep.username, password=ep.password)
    return client


def new_stream(url: str, *, prefix: str = "test-stream") -> str:
    """A stream of the caller's own, created now (a unique name)."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        client = await _client(url)
        try:
            await client.create_stream(name, {"max-length-bytes": 200_000_000})
        finally:
            await client.close()

    asyncio.run(create())
    return name


def delete_stream(url: str, name: str) -> None:
    async def delete() -> None:
        client = await _client(url)
        try:
            await client.delete_stream(name)
        finally:
            await client.close()

    asyncio.run(delete())


@dataclass(frozen=True)
class StreamContents:
    """Every message id read from a stream, in offset order."""

    ids: list[str]

    @property
    def counts(self) -> Counter[str]:
        return Counter(self.ids)

    def duplicates(self) -> dict[str, int]:
        return {k: v for k, v in self.counts.items() if v > 1}

    def missing(self, expected: set[str]) -> set[str]:
        return expected - set(self.ids)


def read_stream(url: str, name: str, *, expect: int, timeout: float = 30.0) -> StreamContents:
    """Read ``name`` from its first offset until ``expect`` messages arrived, then one second
    more (a duplicate after them would show), or until ``timeout``."""

    async def read() -> list[str]:
        ep = StreamEndpoint.parse(url)
        consumer = Consumer(
            host=ep.host,
            port=ep.port,
            vhost=ep.vhost,
            username=ep.username,
            password=ep.password,
        )
        await consumer.start()
        seen: list[str] = []
        enough = asyncio.Event()

        async def on_message(message: object, context: object) -> None:
            mid = message.properties.message_id  # type: ignore[attr-defined]
            seen.append(mid.decode() if isinstance(mid, bytes) else str(mid))
            if len(seen) >= expect:
                enough.set()

        try:
            await consumer.subscribe(
                stream=name,
                callback=on_message,
                decoder=amqp_decoder,
                offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(enough.wait(), timeout)
            await asyncio.sleep(1.0)
        finally:
            await consumer.close()
        return seen

    return StreamContents(asyncio.run(read()))
