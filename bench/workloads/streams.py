"""The drain into a stream beside the drain into a classic queue, in the same run (issue 46).

Both seed the same backlog with COPY into a fresh PostgreSQL database and run one publisher
process with ``--until-empty``; the stream drain's rows name a stream (created for the run,
deleted after), the queue drain's an exchange bound to a classic queue. Each reports rows/s and
CPU per row of the publisher, PostgreSQL and RabbitMQ. The stream is read whole afterwards:
a drain that left a duplicate or missed a message is a broken workload, not a number.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg

from bench.common import BODY, Measured, Services, Sizes, libpq_url, temp_postgres
from bench.proccpu import ServiceCpu
from bench.workloads.drain import (
    DrainResult,
    _confirmed,
    _drain_repeat,
    drain_once,
    start_publisher,
)
from tests.support.streams import delete_stream, new_stream, read_stream


def _url() -> str:
    return os.environ.get("OUTBOX_STREAM_URL", "rabbitmq-stream://guest:guest@127.0.0.1:5553/")


@contextlib.contextmanager
def _stream() -> Iterator[str]:
    name = new_stream(_url(), prefix="bench-stream")
    try:
        yield name
    finally:
        delete_stream(_url(), name)


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
        seen = read_stream(_url(), stream, expect=n, timeout=60 + n / 5000).counts
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
