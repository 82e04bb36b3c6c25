"""``wait="confirmed"``: a Spark write returns once the broker settled its rows, with what became
of them, and fails naming the batch and the counts when a row was not confirmed.

Against the real RabbitMQ and a real publisher (``running_publisher``, FAST settings: a return
ends a row ``returned`` at once, no grace). The Spark writes block, so they run in a thread
while the publisher runs on the test's loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from app.db import make_engine
from spark_writer import OutboxDeliveryError, OutboxSink, write_outbox
from tests.publisher_support import declare, delete, running_publisher, settings_for
from tests.spark.test_spark_writer import await_stream

pytestmark = pytest.mark.spark


@pytest.fixture
async def exchange(amqp_url: str) -> AsyncIterator[str]:
    """A durable direct exchange of this test's own with a queue bound by ``rk``."""
    name = f"test-wait-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=name, queue=name)
    yield name
    await delete(amqp_url, exchanges=(name,), queues=(name,))


def frame(spark: SparkSession, n: int, *, key: str = "rk") -> DataFrame:
    return spark.range(n, numPartitions=2).selectExpr(
        "concat('m', id) AS id", f"'{key}' AS key", "concat('order ', id) AS body"
    )


def options(url: str, exchange: str, **kw: Any) -> dict[str, Any]:
    base = {
        "url": url,
        "sink": "waits",
        "exchange": exchange,
        "routing_key_column": "key",
        "body_column": "body",
        "message_id_column": "id",
        "wait": "confirmed",
        "wait_timeout": 60.0,
    }
    return base | kw


async def test_a_batch_job_waits_for_its_confirms_and_returns_the_summary(
    spark: SparkSession, db_url: str, amqp_url: str, exchange: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(db_url)
    caplog.set_level(logging.INFO, logger="spark_writer")
    async with running_publisher(settings_for(db_url=db_url, amqp_url=amqp_url), engine):
        result = await asyncio.to_thread(
            write_outbox, frame(spark, 300), batch_id=7, **options(db_url, exchange)
        )
    engine.dispose()
    d = result.delivery
    assert d is not None and d.ok and not d.timed_out
    assert (d.batch_id, d.rows, d.confirmed, d.undelivered, d.open) == ("waits:7", 300, 300, 0, 0)
    assert result.written == 300
    line = next(r.getMessage() for r in caplog.records if "delivered in" in r.getMessage())
    assert "outbox batch waits:7: delivered in" in line and "300 row(s): 300 confirmed" in line


async def test_with_the_publisher_stopped_the_wait_times_out_and_a_rerun_waits_again(
    spark: SparkSession, pg_url: str, amqp_url: str, exchange: str
) -> None:
    df = frame(spark, 50)
    opts = options(pg_url, exchange, wait_timeout=1.0)
    with pytest.raises(OutboxDeliveryError) as caught:
        await asyncio.to_thread(write_outbox, df, batch_id=3, **opts)
    error = caught.value
    assert error.timed_out and error.batch_id == "waits:3"
    message = str(error)
    assert "batch waits:3: not settled after waiting 1." in message
    assert "50 row(s): 0 confirmed, 50 pending" in message
    assert "no row was claimed: is a publisher running on this outbox?" in message
    assert "The batch is recorded: re-running the job adds no row and waits again" in message
    assert error.result is not None and error.result.written == 50  # written, recorded

    engine = make_engine(pg_url)
    async with running_publisher(settings_for(db_url=pg_url, amqp_url=amqp_url), engine):
        again = await asyncio.to_thread(write_outbox, df, batch_id=3, **opts | {"wait_timeout": 60})
    engine.dispose()
    assert again.replayed and again.written == 0  # nothing written twice
    assert again.delivery is not None and again.delivery.confirmed == 50 and again.delivery.ok


async def test_an_unroutable_key_fails_the_job_naming_the_returned_rows(
    spark: SparkSession, db_url: str, amqp_url: str, exchange: str
) -> None:
    """Row 0 of ordering key k0 goes to a routing key nothing is bound to: it comes back
    ``returned`` 312 NO_ROUTE, the later rows of k0 wait behind it (blocked: the wait does not
    wait for them), the rows without a key are confirmed."""
    df = spark.range(40, numPartitions=2).selectExpr(
        "concat('m', id) AS id",
        "CASE WHEN id = 0 THEN 'nowhere' ELSE 'rk' END AS key",
        "CASE WHEN id < 5 THEN 'k0' END AS okey",
        "concat('order ', id) AS body",
    )
    engine = make_engine(db_url)
    opts = options(db_url, exchange, ordering_key_column="okey")
    async with running_publisher(settings_for(db_url=db_url, amqp_url=amqp_url), engine):
        with pytest.raises(OutboxDeliveryError) as caught:
            await asyncio.to_thread(write_outbox, df, batch_id=1, **opts)
    engine.dispose()
    d = caught.value.delivery
    assert not d.timed_out and d.waited < 30
    assert (d.confirmed, d.returned, d.pending, d.blocked) == (35, 1, 4, 4)
    assert d.reasons[0][:3] == ("returned", "312 NO_ROUTE", 1) and d.reasons[0].first == "m0"
    message = str(caught.value)
    assert "batch waits:1: 5 of 40 row(s) not delivered" in message
    assert "1 returned" in message and "4 blocked behind a failed row of their key" in message
    assert "returned 312 NO_ROUTE: 1 row(s), first m0" in message
    assert "outbox republish --batch waits:1" in message


async def test_a_stream_waits_per_micro_batch_and_its_sink_counts_the_delivery(
    spark: SparkSession, pg_url: str, amqp_url: str, exchange: str, tmp_path: Path
) -> None:
    sink = OutboxSink(**options(pg_url, exchange, sink="waits-stream"))
    source = tmp_path / "in"
    frame(spark, 60).write.json(str(source))
    engine = make_engine(pg_url)
    async with running_publisher(settings_for(db_url=pg_url, amqp_url=amqp_url), engine):
        query = (
            spark.readStream.schema("id string, key string, body string")
            .option("maxFilesPerTrigger", 1)
            .json(str(source))
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        await asyncio.to_thread(await_stream, query)
    engine.dispose()
    t = sink.totals
    assert (t.rows, t.written, t.confirmed, t.undelivered_batches) == (60, 60, 60, 0)
    assert sink.last_result is not None and sink.last_result.delivery is not None
