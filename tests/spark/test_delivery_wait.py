"""``wait="confirmed"``: a Spark write returns once the broker settled its rows, with what became
of them, and fails naming the batch and the counts when a row was not confirmed.

Against the real RabbitMQ and a real publisher (``running_publisher``, FAST settings: a return
ends a row ``returned`` at once, no grace). The Spark writes block, so they run in a thread
while the publisher runs on the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from app.db import make_engine
from spark_writer import OutboxDeliveryError, OutboxProgress, OutboxSink, write_outbox
from tests.support import dbview
from tests.support.env import REPO, scrubbed_environ
from tests.support.publisher import declare, delete, running_publisher, settings_for
from tests.support.spark import await_stream

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


def file_source(spark: SparkSession, tmp_path: Path, n: int) -> DataFrame:
    """A stream of ``n`` rows in two files, one micro-batch each."""
    source = tmp_path / "in"
    frame(spark, n).coalesce(2).write.json(str(source))
    schema = "id string, key string, body string"
    return spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(source))


def kept_progress(listener: OutboxProgress, query: Any, batches: int) -> list[dict[str, Any]]:
    """The listener's progress once Spark's listener bus delivered ``batches`` events."""
    deadline = time.monotonic() + 30
    while len(listener.progress(query)) < batches:
        assert time.monotonic() < deadline, listener.progress(query)
        time.sleep(0.05)
    return listener.progress(query)


@pytest.mark.spark_api
async def test_a_streams_progress_shows_each_micro_batchs_delivery(
    spark: SparkSession,
    pg_url: str,
    amqp_url: str,
    exchange: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``OutboxSink`` waits per micro-batch; ``sink.progress``, a listener, puts Spark's own
    progress of each micro-batch beside what the outbox did with it, and logs a line."""
    caplog.set_level(logging.INFO, logger="spark_writer.progress")
    sink = OutboxSink(**options(pg_url, exchange, sink="waits-stream", message_id_column=None))
    spark.streams.addListener(sink.progress)
    engine = make_engine(pg_url)
    try:
        async with running_publisher(settings_for(db_url=pg_url, amqp_url=amqp_url), engine):
            query = (
                file_source(spark, tmp_path, 60)
                .writeStream.foreachBatch(sink)
                .option("checkpointLocation", str(tmp_path / "checkpoint"))
                .trigger(availableNow=True)
                .start()
            )
            await asyncio.to_thread(await_stream, query)
        kept = await asyncio.to_thread(kept_progress, sink.progress, query, 2)
    finally:
        spark.streams.removeListener(sink.progress)
        engine.dispose()
    assert [p["batchId"] for p in kept] == [0, 1]
    for p in kept:
        o = p["outbox"]
        assert p["sink"]["numOutputRows"] == -1  # Spark's own figure for foreachBatch
        assert o["batchId"] == f"waits-stream:{p['batchId']}"
        assert o["written"] == o["rows"] == o["confirmed"] == p["numInputRows"] > 0
        assert (o["returned"], o["nacked"], o["failed"], o["pending"]) == (0, 0, 0, 0)
        assert o["waitSeconds"] >= 0
    t = sink.totals
    assert (t.batches, t.rows, t.written, t.confirmed, t.undelivered_batches) == (2, 60, 60, 60, 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "spark_writer.progress"]
    assert any(
        f"batch 1: {kept[1]['numInputRows']} input rows in" in line
        and "outbox batch waits-stream:1: " in line
        and "confirmed, 0 returned, 0 nacked, 0 failed, 0 skipped, 0 open" in line
        for line in lines
    ), lines


@pytest.mark.spark_api
async def test_a_data_source_stream_waits_and_its_progress_reads_the_outbox(
    spark: SparkSession, pg_url: str, amqp_url: str, exchange: str, tmp_path: Path
) -> None:
    """``format("outbox")`` with ``wait``: each micro-batch commits once its rows are
    confirmed. Its commit runs in a Python worker of its own, so the listener, given the sink
    and the query's name, reads each batch's rows per status from the outbox; Spark's own
    ``numOutputRows`` counts the rows written."""
    listener = OutboxProgress(url=pg_url, sink="waits-ds", query_name="waits-ds")
    spark.streams.addListener(listener)
    engine = make_engine(pg_url)
    try:
        async with running_publisher(settings_for(db_url=pg_url, amqp_url=amqp_url), engine):
            query = (
                file_source(spark, tmp_path, 40)
                .writeStream.format("outbox")
                .queryName("waits-ds")
                .option("url", pg_url)
                .option("sink", "waits-ds")
                .option("exchange", exchange)
                .option("routingKeyColumn", "key")
                .option("bodyColumn", "body")
                .option("messageIdColumn", "id")
                .option("wait", "confirmed")
                .option("waitTimeout", "60")
                .option("checkpointLocation", str(tmp_path / "checkpoint"))
                .trigger(availableNow=True)
                .start()
            )
            await asyncio.to_thread(await_stream, query)
        kept = await asyncio.to_thread(kept_progress, listener, query, 2)
    finally:
        spark.streams.removeListener(listener)
        engine.dispose()
    assert sum(p["outbox"]["confirmed"] for p in kept) == 40
    for p in kept:
        o = p["outbox"]
        assert o["rows"] == o["confirmed"] == p["sink"]["numOutputRows"] == p["numInputRows"]
        assert "written" not in o  # the data source's result stays in its worker


@contextlib.contextmanager
def publisher_process(db_url: str, amqp_url: str) -> Iterator[None]:
    """``python -m app.publisher`` of this test's own: a ``format("outbox")`` batch write finds
    the data source only from the thread that registered it, so it runs on the test's thread
    and the publisher beside it in a process (returns end rows ``returned`` at once)."""
    env = scrubbed_environ(os.environ) | {
        "OUTBOX_DATABASE_URL": db_url,
        "OUTBOX_AMQP_URL": amqp_url,
        "OUTBOX_RETURN_GRACE": "0",
        "OUTBOX_PUBLISHER_METRICS_PORT": "0",
        "OUTBOX_SHUTDOWN_TIMEOUT": "5",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.publisher"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.spark_api
def test_a_data_source_write_that_waits_fails_naming_the_returned_rows(
    spark: SparkSession, pg_url: str, amqp_url: str, exchange: str
) -> None:
    writer = (
        frame(spark, 10, key="nowhere")
        .write.format("outbox")
        .mode("append")
        .option("url", pg_url)
        .option("sink", "waits-ds")
        .option("batchId", 5)
        .option("exchange", exchange)
        .option("routingKeyColumn", "key")
        .option("bodyColumn", "body")
        .option("messageIdColumn", "id")
        .option("wait", "confirmed")
        .option("waitTimeout", "60")
    )
    not_delivered = r"batch waits-ds:5: 10 of 10 row\(s\) not delivered: .* 10 returned"
    with publisher_process(pg_url, amqp_url), pytest.raises(Exception, match=not_delivered):
        writer.save()


@pytest.mark.spark_api  # PySpark's pinned threads: the function sees its JVM thread's interrupt
def test_stopping_a_query_that_waits_ends_its_wait_at_once(
    spark: SparkSession, pg_url: str, tmp_path: Path
) -> None:
    """Spark's ``stop()`` waits for the ``foreachBatch`` function: without a publisher the
    wait would hold it for the whole timeout (measured: 23.7 s of a 25 s timeout). The wait
    asks at each poll whether its query was stopped, and fails the batch saying so."""
    sink = OutboxSink(**options(pg_url, "x", sink="waits-stop", wait_timeout=120))
    query = (
        file_source(spark, tmp_path, 10)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    deadline = time.monotonic() + 60
    while not dbview.batches(pg_url):  # the first micro-batch is recorded: its wait runs
        assert time.monotonic() < deadline and query.isActive
        time.sleep(0.1)
    time.sleep(1.5)
    assert query.isActive and query.exception() is None  # still waiting, nothing failed
    began = time.monotonic()
    query.stop()
    assert time.monotonic() - began < 5
    stopped = re.search(
        r"batch waits-stop:0: its streaming query was stopped after waiting ([\d.]+)s",
        str(query.exception()),
    )
    assert stopped is not None and float(stopped.group(1)) >= 1.5
