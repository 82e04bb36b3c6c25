"""A message id the outbox holds for another message is never skipped silently.

Message ids are one namespace across sinks. A row whose id is in the outbox already is dropped
only when it is the same message (same sink, exchange, routing key, body, headers, ...): a
replay. Otherwise it is a conflict: an error in fail mode, a reject with its reason in reject
mode, and ``BatchResult`` counts replays (``duplicates``) and ``conflicts`` apart. On
PostgreSQL and on SQLite, through ``write_outbox``, ``OutboxSink`` and ``format("outbox")``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_writer import OutboxDataError, OutboxSink, PartitionResult, write_outbox
from tests.support import dbview
from tests.support.spark import orders, sink_options

pytestmark = pytest.mark.spark


def keyed(url: str, **kw: object) -> dict[str, object]:
    return sink_options(url, message_id_column="id") | kw


def bodies(url: str, batch_id: str) -> list[bytes]:
    return sorted(r["body"] for r in dbview.outbox(url) if r["batch_id"] == batch_id)


def test_same_key_from_another_sink_is_an_error_in_fail_mode_and_loses_nothing(
    spark: SparkSession, db_url: str
) -> None:
    first = write_outbox(orders(spark, 20), batch_id=1, **keyed(db_url))
    assert (first.written, first.conflicts) == (20, 0)
    before = dbview.outbox(db_url)
    # ids 0-19 (partition 0) belong to sink "orders"; ids 20-39 (partition 1) are new
    with pytest.raises(OutboxDataError) as caught:
        write_outbox(orders(spark, 40), batch_id=1, **keyed(db_url, sink="refunds"))
    message = str(caught.value)
    assert "message id already in the outbox for another message: 20 row(s)" in message
    assert "is held by a row of batch orders:1 with another sink" in message
    assert "batch refunds:1: 20 invalid row(s), nothing written" in message
    assert caught.value.written is None
    # sink "orders" keeps its 20 rows exactly as they were; partition 1 of "refunds", which
    # committed into the held batch, was removed with it: nothing of the batch is published
    assert dbview.outbox(db_url) == before
    assert [b["batch_id"] for b in dbview.batches(db_url)] == ["orders:1"]


def test_same_key_from_another_sink_is_rejected_with_its_reason_in_reject_mode(
    spark: SparkSession, db_url: str
) -> None:
    write_outbox(orders(spark, 20), batch_id=1, **keyed(db_url))
    other = keyed(db_url, sink="refunds", exchange="refunds.x", on_invalid="reject")
    result = write_outbox(orders(spark, 40), batch_id=7, **other)
    assert (result.rows, result.written, result.duplicates) == (40, 20, 0)
    assert (result.rejected, result.conflicts) == (20, 20)
    rejects = dbview.rejects(db_url)
    assert sorted(int(r["message_id"]) for r in rejects) == list(range(20))
    reason = rejects[0]["reason"]
    assert "is held by a row of batch orders:1 with another sink, exchange" in reason
    refused = json.loads(rejects[0]["row_json"])
    assert refused["exchange"] == "refunds.x" and refused["batch_id"] == "refunds:7"
    assert refused["body"] == f"order {refused['message_id']}"
    recorded = {b["batch_id"]: b for b in dbview.batches(db_url)}
    assert (recorded["refunds:7"]["row_count"], recorded["refunds:7"]["rejected_count"]) == (20, 20)
    assert bodies(db_url, "orders:1") == sorted(f"order {i}".encode() for i in range(20))


def test_a_true_replay_under_another_batch_is_a_duplicate_and_a_changed_body_a_conflict(
    spark: SparkSession, db_url: str
) -> None:
    write_outbox(orders(spark, 10), batch_id=1, **keyed(db_url))
    again = write_outbox(orders(spark, 10), batch_id=2, **keyed(db_url))
    assert (again.written, again.duplicates, again.conflicts) == (0, 10, 0)

    changed = orders(spark, 10).withColumn(
        "payload", F.when(F.col("id") == 3, F.lit("order 3, amended")).otherwise(F.col("payload"))
    )
    with pytest.raises(OutboxDataError, match=r"message id '3' is held .* another body"):
        write_outbox(changed, batch_id=3, **keyed(db_url))
    result = write_outbox(changed, batch_id=4, **keyed(db_url, on_invalid="reject"))
    assert (result.written, result.duplicates, result.rejected, result.conflicts) == (0, 9, 1, 1)
    assert [r["message_id"] for r in dbview.rejects(db_url)] == ["3"]
    assert b"order 3" in bodies(db_url, "orders:1")  # the first message stands


def test_two_rows_of_one_batch_with_one_key_and_different_content(
    spark: SparkSession, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # id 5 twice: once as "order 5", once as "order 25" (row 25 takes id 5); row 6 twice, equal
    df = orders(spark, 30).withColumn(
        "id", F.when(F.col("id") == 25, F.lit(5)).otherwise(F.col("id"))
    )
    df = df.unionByName(orders(spark, 30).where("id = 6")).coalesce(2)
    with pytest.raises(OutboxDataError, match=r"message id '5' is held .* another .*body"):
        write_outbox(df, batch_id=1, **keyed(db_url))
    dbview.execute(db_url, "DELETE FROM outbox")  # whatever the other partition committed
    with caplog.at_level(logging.INFO, logger="spark_writer"):
        result = write_outbox(df, batch_id=2, **keyed(db_url, on_invalid="reject"))
    assert (result.rows, result.written, result.duplicates) == (31, 29, 1)
    assert (result.rejected, result.conflicts) == (1, 1)
    (reject,) = dbview.rejects(db_url)
    assert reject["message_id"] == "5" and "body" in reject["reason"]
    assert len(dbview.outbox(db_url)) == 29
    assert "1 message id conflict(s) rejected, first: message id '5'" in caplog.text


@pytest.mark.spark_api
def test_foreach_batch_and_data_source_report_conflicts_too(
    spark: SparkSession, db_url: str
) -> None:
    write_outbox(orders(spark, 4), batch_id=1, **keyed(db_url))
    sink = OutboxSink(**keyed(db_url, sink="audit", on_invalid="reject"))  # type: ignore[arg-type]
    result = sink(orders(spark, 6), 0)
    assert (result.written, result.rejected, result.conflicts) == (2, 4, 4)

    writer = (
        orders(spark, 8)
        .write.format("outbox")
        .mode("append")
        .options(url=db_url, sink="mirror", batchId=1, exchange="orders.x")
        .options(routingKeyColumn="region", bodyColumn="payload", messageIdColumn="id")
    )
    with pytest.raises(Exception, match="message id already in the outbox for another message"):
        writer.save()
    assert not [b for b in dbview.batches(db_url) if b["batch_id"] == "mirror:1"]
    # ids 0-5 are taken by "orders" and "audit"; in fail mode the data source parks its rows
    # until the commit, so the rows of the clean partition (6, 7) were removed, not published
    assert not [r for r in dbview.outbox(db_url) if r["batch_id"] == "mirror:1"]


@pytest.mark.spark_api
def test_max_connections_caps_the_partitions_that_write_at_once(
    spark: SparkSession, pg_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "tasks.log"

    def note(result: PartitionResult) -> None:  # runs in the executor's Python worker
        with log.open("a") as f:
            f.write(f"{result.partition} {result.rows}\n")

    df = orders(spark, 40).repartition(4)
    result = write_outbox(
        df, batch_id=1, max_connections=1, on_partition_committed=note, **keyed(pg_url)
    )
    assert (result.rows, result.written) == (40, 40)
    assert log.read_text().split("\n") == ["0 40", ""]  # one task, one connection, every row
    with pytest.raises(ValueError, match="max_connections must be at least 1"):
        write_outbox(df, batch_id=2, max_connections=0, **keyed(pg_url))
    writer = df.write.format("outbox").options(url=pg_url, sink="s", maxConnections="2")
    with pytest.raises(Exception, match=r"cap them with df.coalesce\(N\)"):
        writer.options(batchId="1", exchange="x", routingKey="k").mode("append").save()
