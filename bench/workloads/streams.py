"""The drain into a stream beside the drain into a classic queue, in the same run (issue 46).

Both seed the same backlog with COPY into a fresh PostgreSQL database and run one publisher
process with ``--until-empty``; the stream drain's rows name a stream (created for the run,
deleted after), the queue drain's an exchange bound to a classic queue. Each reports rows/s and
CPU per row of the publisher, PostgreSQL and RabbitMQ. The stream is read whole afterwards:
a drain that left a duplicate or missed a message is a broken workload, not a number.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import tempfile
import uuid
from collections import Counter
from pathlib import Path

import psycopg
from rstream.amqp import amqp_decoder
from rstream.client import Client
from rstream.constants import ConsumerOffsetSpecification, OffsetType
from rstream.consumer import Consumer

from app.streams.relay import StreamEndpoint
from bench.common import BODY, Measured, Services, Sizes, libpq_url, temp_postgres
from bench.proccpu import ServiceCpu
from bench.workloads.drain import (
    DrainResult,
    _confirmed,
    _drain_repeat,
    drain_once,
    start_publisher,
)


def _endpoint() -> StreamEndpoint:
    return StreamEndpoint.parse(
        os.environ.get("OUTBOX_STREAM_URL", "rabbitmq-stream://guest:guest@127.0.0.1:5553/")
    )


async def _client(ep: StreamEndpoint) -> Client:
    client = Client(host=ep.host, port=ep.port, frame_max=1024 * 1024, heartbeat=60)
    await client.start()
    await client.authenticate(vhost=ep.vhost, username=ep.username, password=ep.password)
    return client


@contextlib.contextmanager
def _stream():  # type: ignore[no-untyped-def]
    ep = _endpoint()
    name = f"bench-stream-{uuid.uuid4().hex[:8]}"

    async def make() -> None:
        client = await _client(ep)
        try:
            await client.create_stream(name, {"max-length-bytes": 2_000_000_000})
        finally:
            await client.close()

    async def drop() -> None:
        client = await _client(ep)
        try:
            await client.delete_stream(name)
        finally:
            await client.close()

    asyncio.run(make())
    try:
        yield name
    finally:
        asyncio.run(drop())


def _count(stream: str, expect: int, timeout: float) -> Counter[str]:
    """Every message id of ``stream`` from its first offset (until ``expect`` came, then 1 s)."""
    ep = _endpoint()

    async def read() -> Counter[str]:
        consumer = Consumer(
            host=ep.host, port=ep.port, vhost=ep.vhost, username=ep.username, password=ep.password
        )
        await consumer.start()
        seen: Counter[str] = Counter()
        enough = asyncio.Event()

        async def on_message(message: object, context: object) -> None:
            seen[str(message.properties.message_id)] += 1  # type: ignore[attr-defined]
            if sum(seen.values()) >= expect:
                enough.set()

        try:
            await consumer.subscribe(
                stream=stream,
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

    return asyncio.run(read())


def _seed(url: str, *, n: int, stream: str) -> None:
    prefix = uuid.uuid4().hex[:8]
    copy = "COPY outbox (message_id, batch_id, exchange, routing_key, body, stream) FROM STDIN"
    with psycopg.connect(libpq_url(url)) as conn, conn.cursor() as cur:
        with cur.copy(copy) as cp:
            for i in range(n):
                cp.write_row((f"{prefix}-{i}", f"bench:{i // 10_000}", "", "", BODY, stream))
        conn.commit()
        cur.execute("ANALYZE outbox")
        conn.commit()


def stream_drain_once(services: Services, *, n: int) -> DrainResult:
    with (
        temp_postgres(services) as db_url,
        _stream() as stream,
        tempfile.TemporaryDirectory(prefix="outbox-bench-log-") as logdir,
    ):
        _seed(db_url, n=n, stream=stream)
        cpu = ServiceCpu(postgresql=services.database_port, rabbitmq=services.broker_port)
        cpu.start()
        start = dt.datetime.now(dt.UTC)
        proc = start_publisher(services, db_url, Path(logdir), until_empty=True, name="stream")
        proc.wait(120 + n / 500)
        proc.check()
        used = cpu.stop()
        count, first, last = _confirmed(db_url)
        seen = _count(stream, n, timeout=60 + n / 5000)
    if count != n or first is None or last is None:
        raise RuntimeError(f"stream drain: {count} of {n} rows confirmed")
    duplicates = sum(v - 1 for v in seen.values())
    if len(seen) != n or duplicates:
        raise RuntimeError(
            f"stream drain: {len(seen)} of {n} ids in the stream, {duplicates} twice"
        )
    seconds = (last - start).total_seconds()
    return DrainResult(
        rows_per_s=n / seconds,
        seconds=seconds,
        first_confirm_s=(first - start).total_seconds(),
        peak_rss_mb=[proc.peak_rss_kb / 1024],
        cpu_seconds=[proc.cpu_seconds],
        duplicates=duplicates,
        service_cpu=used,
    )


def run(services: Services, sizes: Sizes) -> list[Measured]:
    n = sizes.drain
    return [
        # the same backlog into a classic queue, in this group: the comparison of one run
        _drain_repeat(
            "drain_postgres_queue_beside_stream",
            lambda: drain_once(services, backend="postgresql", n=n),
        ),
        _drain_repeat("drain_postgres_stream", lambda: stream_drain_once(services, n=n)),
    ]
