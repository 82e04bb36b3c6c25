"""End to end: Spark rows -> outbox -> publisher (killed with kill -9 mid-window, so some rows are
published twice) -> queue -> the consumer kit: each row's effect happens exactly once."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from sqlalchemy import func, select

from app.consumer import Consumer, ConsumerConfig
from app.db import make_engine
from app.outbox.schema import outbox
from spark_writer import write_outbox
from tests.support.consumer import create_effects, effects, record
from tests.support.publisher import declare, delete

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]
ROWS = 3000


def _publisher(pg_url: str, amqp_url: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": pg_url,
        "OUTBOX_AMQP_URL": amqp_url,
        "OUTBOX_LEASE_SECONDS": "2",
        "OUTBOX_FLUSH_INTERVAL": "0.5",  # acks wait: dups
        "OUTBOX_CLAIM_BATCH": "250",
        "OUTBOX_WINDOW": "500",
        "OUTBOX_PUBLISHER_METRICS_PORT": "0",
        "OUTBOX_SHUTDOWN_TIMEOUT": "5",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "app.publisher"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_spark_to_consumer_effects_exactly_once_through_a_publisher_kill(
    spark: SparkSession, pg_url: str, amqp_url: str
) -> None:
    engine = make_engine(pg_url)
    create_effects(engine)
    name = f"test-e2e-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=name, queue=name)
    df = spark.range(ROWS).selectExpr("cast(id as string) as id", "concat('order ', id) as body")
    result = write_outbox(
        df,
        url=pg_url,
        sink="e2e",
        batch_id=1,
        exchange=name,
        routing_key="rk",
        body_column="body",
        message_id_column="id",
    )
    assert result.written == ROWS
    consumer = Consumer(
        config=ConsumerConfig(name="e2e", queue=name, prefetch=200),
        amqp_url=amqp_url,
        engine=engine,
        handler=record,
    )
    stop = asyncio.Event()
    consuming = asyncio.create_task(consumer.run(stop))
    first = _publisher(pg_url, amqp_url)
    second = None
    try:
        deadline = time.monotonic() + 60
        while _count(engine, "in_flight") < 300 or _count(engine, "confirmed") < 300:
            assert time.monotonic() < deadline and first.poll() is None
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the claimed rows go out and are acked; the write-back waits
        first.send_signal(signal.SIGKILL)  # published and acked, the confirms not yet written
        first.wait(timeout=30)
        second = _publisher(pg_url, amqp_url)
        deadline = time.monotonic() + 120
        while len(set(effects(engine))) < ROWS or _open(engine):
            assert time.monotonic() < deadline, "the drain did not finish"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # late duplicates still arrive and are absorbed
    finally:
        stop.set()
        await asyncio.wait_for(consuming, 30)
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        await delete(amqp_url, exchanges=(name,), queues=(name,))
    got = collections.Counter(effects(engine))
    assert len(got) == ROWS and max(got.values()) == 1, got.most_common(3)
    c = consumer.metrics.counts
    assert c["handled"] == ROWS
    assert c["deduplicated"] == c["deliveries"] - ROWS  # every extra delivery absorbed
    with engine.connect() as conn:  # the kill left publishes unconfirmed: sent again
        lost = conn.execute(select(func.sum(outbox.c.lost_confirms))).scalar_one()
    assert lost and lost > 0
    assert c["deduplicated"] > 0, (c, lost)  # ...and some of those reached the queue twice
    engine.dispose()


def _count(engine: object, status: str) -> int:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        stmt = select(func.count()).where(outbox.c.status == status)
        return int(conn.execute(stmt).scalar_one())


def _open(engine: object) -> int:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        stmt = select(func.count()).where(outbox.c.status != "confirmed")
        return int(conn.execute(stmt).scalar_one())
