"""The writers against a real local SparkSession, on PostgreSQL and on SQLite."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DecimalType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from spark_writer import (
    OutboxConfigError,
    OutboxDataError,
    OutboxSchemaError,
    OutboxSink,
    PartitionResult,
    sinks,
    write_outbox,
)
from tests.support import dbview
from tests.support.spark import (
    ORDERS,
    await_stream,
    fail_on_row_25,
    orders,
    sink_options,
    write_order_files,
)

pytestmark = [pytest.mark.spark, pytest.mark.spark_api]


def file_stream(spark: SparkSession, directory: Path) -> DataFrame:
    return spark.readStream.schema(ORDERS).option("maxFilesPerTrigger", 1).json(str(directory))


def forget_last_batch(checkpoint: Path) -> int:
    """Remove the newest entry of the commit log: on restart Spark runs that batch id again."""
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    return last


def no_jobs_in(spark: SparkSession, group: str) -> bool:
    return not spark.sparkContext.statusTracker().getJobIdsForGroup(group)


# --- streaming: every row exactly once -----------------------------------------------------------


def test_foreach_batch_stream_writes_every_row_once_and_replay_adds_none(
    spark: SparkSession, db_url: str, tmp_path: Path
) -> None:
    docs = write_order_files(tmp_path / "in", files=3, per_file=4)
    sink = OutboxSink(url=db_url, sink="orders", exchange="orders.x", routing_key_column="region")
    calls: list[tuple[int, Any]] = []

    def run(df: DataFrame, batch_id: int) -> None:
        calls.append((batch_id, sink(df, batch_id)))

    def start() -> StreamingQuery:
        return (
            file_stream(spark, tmp_path / "in")
            .writeStream.foreachBatch(run)
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )

    query = start()
    await_stream(query)
    rows = dbview.outbox(db_url)
    assert sorted((json.loads(r["body"]) for r in rows), key=lambda d: d["id"]) == docs
    assert len({r["message_id"] for r in rows}) == 12
    assert {r["batch_id"] for r in rows} == {"orders:0", "orders:1", "orders:2"}
    assert {r["content_type"] for r in rows} == {"application/json"}
    assert all(r["status"] == "pending" and not r["available_at"].startswith("9999") for r in rows)
    recorded = dbview.batches(db_url)
    assert [(b["batch_id"], b["row_count"]) for b in recorded] == [
        ("orders:0", 4),
        ("orders:1", 4),
        ("orders:2", 4),
    ]
    assert {b["query_id"] for b in recorded} == {str(query.id)}

    # The driver "dies" after writing batch 2 but before Spark logged it: Spark runs it again.
    replayed = forget_last_batch(tmp_path / "cp")
    calls.clear()
    await_stream(start())
    assert [(bid, result.replayed) for bid, result in calls] == [(replayed, True)]
    assert dbview.counts(db_url) == {"outbox": 12, "outbox_batches": 3, "outbox_rejects": 0}


def test_data_source_stream_writes_every_row_once_and_replay_adds_none(
    spark: SparkSession, db_url: str, tmp_path: Path
) -> None:
    docs = write_order_files(tmp_path / "in", files=2, per_file=5)

    def start() -> StreamingQuery:
        return (
            file_stream(spark, tmp_path / "in")
            .writeStream.format("outbox")
            .options(
                url=db_url,
                sink="orders-ds",
                exchange="orders.x",
                routingKeyColumn="region",
                messageIdColumn="id",
                headerColumns="tenant",
            )
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )

    query = start()
    await_stream(query)
    rows = dbview.outbox(db_url)
    assert sorted(int(r["message_id"]) for r in rows) == [d["id"] for d in docs]
    assert all(r["headers"] == {"tenant": json.loads(r["body"])["tenant"]} for r in rows)
    recorded = dbview.batches(db_url)
    assert [(b["batch_id"], b["row_count"], b["query_id"]) for b in recorded] == [
        ("orders-ds:0", 5, str(query.id)),
        ("orders-ds:1", 5, str(query.id)),
    ]

    forget_last_batch(tmp_path / "cp")
    await_stream(start())
    assert dbview.counts(db_url) == {"outbox": 10, "outbox_batches": 2, "outbox_rejects": 0}


# --- retries and replays -----------------------------------------------------------------------


def test_task_failing_after_its_commit_is_retried_and_adds_no_row(
    spark: SparkSession, db_url: str
) -> None:
    def fail_first_attempt_of_partition_1(result: PartitionResult) -> None:
        if result.partition == 1 and result.attempt == 0:
            raise RuntimeError("injected: executor lost after commit")

    result = write_outbox(
        orders(spark, 40),
        batch_id=1,
        on_partition_committed=fail_first_attempt_of_partition_1,
        **sink_options(db_url),
    )
    # The retry found its rows already there (partition 1's share of the 40: the rows are laid
    # out by their content ids): they count as duplicates, not new rows.
    assert result.rows == 40 and result.written + result.duplicates == 40
    assert 0 < result.duplicates < 40
    rows = dbview.outbox(db_url)
    assert sorted(r["body"] for r in rows) == sorted(f"order {i}".encode() for i in range(40))
    assert [(b["batch_id"], b["row_count"]) for b in dbview.batches(db_url)] == [("orders:1", 40)]


def test_failed_job_records_no_batch_and_its_rerun_writes_the_rest_once(
    spark: SparkSession, db_url: str
) -> None:
    df = orders(spark, 30)
    fails_on_row_25 = F.udf(lambda payload: fail_on_row_25(payload), StringType())
    broken = df.withColumn("payload", fails_on_row_25("payload"))
    options = sink_options(db_url, on_invalid="reject")  # no check pass: the write itself fails
    with pytest.raises(Exception, match="row 25 cannot be computed"):
        write_outbox(broken, batch_id=4, **options)
    # Partition 1 rolled back (twice). Partition 0 (rows 0-14) commits whole or not at all: the
    # failing job cancels it, but it may commit before, or even just after the error is raised.
    # No batch is recorded either way.
    assert dbview.count(db_url, "outbox") in (0, 15)
    assert dbview.count(db_url, "outbox_batches") == 0

    result = write_outbox(df, batch_id=4, **options)
    assert result.duplicates in (0, 15)
    assert (result.rows, result.written) == (30, 30 - result.duplicates)
    assert not result.replayed
    again = write_outbox(df, batch_id=4, **options)
    assert again.replayed and again.written == 0
    rows = dbview.outbox(db_url)
    assert sorted(r["body"] for r in rows) == sorted(f"order {i}".encode() for i in range(30))
    assert [(b["batch_id"], b["row_count"]) for b in dbview.batches(db_url)] == [("orders:4", 30)]


def test_rows_already_in_the_outbox_are_skipped_and_the_rest_written_in_order(
    spark: SparkSession, db_url: str
) -> None:
    keyed = sink_options(db_url, message_id_column="id")
    first = write_outbox(orders(spark, 20).where("id < 10"), batch_id=1, **keyed)
    assert first.written == 10
    # Partition 0 holds ids 0-19 (0-9 there already), partition 1 ids 20-39.
    result = write_outbox(orders(spark, 40), batch_id=2, **keyed)
    assert (result.rows, result.written, result.duplicates) == (40, 30, 10)
    ids = [int(r["message_id"]) for r in dbview.outbox(db_url)]  # in outbox id order
    assert sorted(ids) == list(range(40))
    # Within a partition, outbox ids follow row order (partitions commit in either order).
    assert [i for i in ids if 10 <= i < 20] == list(range(10, 20))
    assert [i for i in ids if i >= 20] == list(range(20, 40))


def test_write_outbox_derives_its_batch_id_from_the_content(
    spark: SparkSession, sqlite_url: str
) -> None:
    first = write_outbox(orders(spark, 10), **sink_options(sqlite_url))
    same = write_outbox(orders(spark, 10), **sink_options(sqlite_url))
    other = write_outbox(orders(spark, 11), **sink_options(sqlite_url))
    assert same.batch_id == first.batch_id and same.replayed
    assert other.batch_id != first.batch_id and not other.replayed
    # Another batch id: content ids carry it, so all 11 rows are new messages.
    assert dbview.count(sqlite_url, "outbox") == 21


# --- bad input -----------------------------------------------------------------------------------


BAD_ROWS = {
    3: {"payload": None},
    9: {"region": "é" * 128},  # 128 characters, 256 bytes
    12: {"region": None},
    14: {"region": "r" * 256},
    17: {"payload": "x" * 65},
}


def test_bad_rows_fail_the_batch_naming_each_problem_and_write_nothing(
    spark: SparkSession, db_url: str
) -> None:
    df = orders(spark, 20, BAD_ROWS)
    with pytest.raises(OutboxDataError) as err:
        write_outbox(df, batch_id=2, max_body_bytes=64, **sink_options(db_url))
    assert {p.summary: p.rows for p in err.value.problems} == {
        "column 'payload' (body) is null": 1,
        "column 'region' (routing key) is null": 1,
        "column 'region' (routing key) is longer than 255 bytes": 2,
        "column 'payload' (body) is over the 64-byte maximum": 1,
    }
    assert "batch orders:2: 5 invalid row(s), nothing written" in str(err.value)
    assert dbview.counts(db_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}


def test_nan_in_a_json_body_or_a_header_is_found_before_any_write(
    spark: SparkSession, sqlite_url: str
) -> None:
    schema = "id LONG, region STRING, tenant STRING, score DOUBLE, tags ARRAY<DOUBLE>"
    rows = [(i, "r", "t", float(i), [1.0]) for i in range(10)]
    rows[3] = (3, "r", "t", float("nan"), [1.0])
    rows[8] = (8, "r", "t", 8.0, [float("-inf")])
    df = spark.createDataFrame(rows, schema).coalesce(2)
    with pytest.raises(OutboxDataError) as err:
        OutboxSink(url=sqlite_url, sink="s", exchange="x", routing_key_column="region")(df, 1)
    assert [(p.summary, p.rows) for p in err.value.problems] == [
        ("row JSON (body) holds NaN or infinity, which JSON cannot carry", 2)
    ]
    with pytest.raises(OutboxDataError) as err:
        OutboxSink(
            url=sqlite_url,
            sink="s",
            exchange="x",
            routing_key_column="region",
            body_column="tenant",
            header_columns=["score"],
            message_id_column="id",
        )(df, 1)
    assert [(p.summary, p.rows, p.first) for p in err.value.problems] == [
        ("header column 'score' is NaN or infinite", 1, "message id 3")
    ]
    assert dbview.counts(sqlite_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}


def test_json_body_over_the_maximum_is_caught_in_the_executor(
    spark: SparkSession, pg_url: str
) -> None:
    # Spark cannot size the JSON the writer will make: the task finds it, its partition writes
    # nothing, the batch is not recorded, and the other partition's rows go with the batch.
    df = orders(spark, 20, {17: {"payload": "x" * 100}})
    with pytest.raises(OutboxDataError) as err:
        write_outbox(
            df,
            url=pg_url,
            sink="orders",
            batch_id=5,
            exchange="orders.x",
            routing_key_column="region",
            max_body_bytes=100,
        )
    assert [(p.summary, p.rows) for p in err.value.problems] == [
        ("row JSON (body) is over the 100-byte maximum", 1)
    ]
    assert err.value.written is None
    assert dbview.counts(pg_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}


def test_reject_mode_writes_good_rows_and_rejects_the_bad_with_reasons(
    spark: SparkSession, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = OutboxSink(on_invalid="reject", max_body_bytes=64, **sink_options(db_url))
    with caplog.at_level(logging.INFO, logger="spark_writer"):
        result = sink(orders(spark, 20, BAD_ROWS), 9)
    # the driver says what the batch did, in one line
    assert (
        "outbox batch orders:9: 20 rows, 15 written, 0 already there (replays of the same "
        "message), 5 rejected (0 of them message id conflicts)" in caplog.text
    )
    assert (result.rows, result.written, result.rejected) == (20, 15, 5)
    assert dbview.count(db_url, "outbox") == 15
    reasons = {json.loads(r["row_json"])["id"]: r["reason"] for r in dbview.rejects(db_url)}
    assert reasons == {
        3: "payload is null",
        9: "region is 256 bytes, over the 255-byte limit",
        12: "region is null",
        14: "region is 256 bytes, over the 255-byte limit",
        17: "body is 65 bytes, over the 64-byte maximum",
    }
    assert [(b["row_count"], b["rejected_count"]) for b in dbview.batches(db_url)] == [(15, 5)]
    with caplog.at_level(logging.INFO, logger="spark_writer"):
        assert sink(orders(spark, 20, BAD_ROWS), 9).replayed
    assert "outbox batch orders:9 recorded before: a replay, nothing written" in caplog.text
    assert dbview.counts(db_url) == {"outbox": 15, "outbox_batches": 1, "outbox_rejects": 5}


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"routing_key_column": "zone"}, "column 'zone' (routing key) not found"),
        ({"body_column": "id"}, "column 'id' (body) has type bigint; expected binary or string"),
        ({"routing_key_column": "id"}, "column 'id' (routing key) has type bigint"),
        ({"header_columns": ["Tenant"]}, "column 'Tenant' (header) not found (did you mean"),
    ],
)
def test_schema_errors_are_raised_on_the_driver_before_any_job(
    spark: SparkSession, sqlite_url: str, kw: dict[str, Any], needle: str
) -> None:
    group = f"schema-{uuid.uuid4().hex[:8]}"
    spark.sparkContext.setJobGroup(group, "schema check")
    try:
        with pytest.raises(OutboxSchemaError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            OutboxSink(**sink_options(sqlite_url, **kw))(orders(spark, 4), 0)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    assert no_jobs_in(spark, group)
    assert dbview.counts(sqlite_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}


# --- the data source ---------------------------------------------------------------------------

MIXED = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("tenant", StringType()),
        StructField("price", DecimalType(10, 2)),
        StructField("score", DoubleType()),
        StructField("ok", BooleanType()),
        StructField("at", TimestampType()),
        StructField("raw", BinaryType()),
        StructField("tags", ArrayType(StringType())),
        StructField("attrs", MapType(StringType(), LongType())),
    ]
)


def mixed(spark: SparkSession) -> DataFrame:
    import datetime as dt
    from decimal import Decimal

    rows = [
        (
            i,
            f"r{i % 3}",
            f"t{i % 2}",
            Decimal(f"{i}.25"),
            i / 4,
            i % 2 == 0,
            dt.datetime(2024, 5, 1, 12, i),
            bytes([i]),
            [f"a{i}", "b"],
            {"k": i},
        )
        for i in range(12)
    ]
    return spark.createDataFrame(rows, MIXED).coalesce(2)


def comparable(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    keys = ("exchange", "routing_key", "mandatory", "body", "content_type", "ordering_key")
    return sorted((*(r[k] for k in keys), json.dumps(r["headers"], sort_keys=True)) for r in rows)


def test_data_source_and_foreach_batch_write_the_same_rows(
    spark: SparkSession, db_url: str
) -> None:
    df = mixed(spark)
    common = {
        "exchange": "orders.x",
        "routing_key_column": "region",
        "mandatory": False,
        "header_columns": ["tenant", "score"],
        "ordering_key_column": "tenant",
    }
    write_outbox(df, url=db_url, sink="fb", batch_id=3, **common)
    (
        df.write.format("outbox")
        .mode("append")
        .options(
            url=db_url,
            sink="ds",
            batchId="3",
            exchange="orders.x",
            routingKeyColumn="region",
            mandatory="false",
            headerColumns="tenant,score",
            orderingKeyColumn="tenant",
        )
        .save()
    )
    rows = dbview.outbox(db_url)
    by_sink = {s: [r for r in rows if r["batch_id"] == f"{s}:3"] for s in ("fb", "ds")}
    assert len(by_sink["fb"]) == len(by_sink["ds"]) == 12
    assert comparable(by_sink["fb"]) == comparable(by_sink["ds"])
    body = json.loads(next(r["body"] for r in by_sink["ds"] if r["headers"]["score"] == 0.25))
    assert body == {
        "id": 1,
        "region": "r1",
        "tenant": "t1",
        "price": "1.25",
        "score": 0.25,
        "ok": False,
        "at": "2024-05-01T12:01:00+00:00",
        "raw": "AQ==",
        "tags": ["a1", "b"],
        "attrs": {"k": 1},
    }
    assert [(b["batch_id"], b["row_count"]) for b in dbview.batches(db_url)] == [
        ("ds:3", 12),
        ("fb:3", 12),
    ]


def test_data_source_in_fail_mode_writes_nothing_when_any_row_is_bad(
    spark: SparkSession, db_url: str
) -> None:
    def writer(df: DataFrame, **extra: str) -> Any:
        return (
            df.write.format("outbox")
            .mode("append")
            .options(url=db_url, sink="ds", batchId="1", exchange="orders.x")
            .options(routingKeyColumn="region", bodyColumn="payload", **extra)
        )

    bad = orders(spark, 20, {15: {"region": None}})
    with pytest.raises(Exception, match=r"column 'region' \(routing key\) is null: 1 row") as err:
        writer(bad).save()
    # The data source sees rows only in its tasks: partition 0 (rows 0-9) was clean and wrote
    # its rows parked (never due); the failing commit removed them. Nothing was published.
    assert "invalid row(s), nothing written" in str(err.value)
    assert dbview.counts(db_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}

    writer(orders(spark, 20)).save()  # fixed: every row written and due at once, on commit
    rows = dbview.outbox(db_url)
    assert len(rows) == 20 and not [r for r in rows if r["available_at"].startswith("9999")]
    assert [(b["batch_id"], b["row_count"]) for b in dbview.batches(db_url)] == [("ds:1", 20)]

    # reject mode parks nothing: good rows are due when their partition commits
    writer(bad, onInvalid="reject", sink="ds-r").save()
    rows = [r for r in dbview.outbox(db_url) if r["batch_id"] == "ds-r:1"]
    assert len(rows) == 19 and not [r for r in rows if r["available_at"].startswith("9999")]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"routingKeyColumn": "zone"}, "column 'zone' \\(routing key\\) not found"),
        ({"batchId": None}, "needs option batchId"),
        ({"colour": "red"}, "unknown outbox option 'colour'"),
    ],
)
def test_data_source_option_and_schema_errors_are_clear(
    spark: SparkSession, sqlite_url: str, extra: dict[str, str | None], needle: str
) -> None:
    options = {
        "url": sqlite_url,
        "sink": "ds",
        "batchId": "1",
        "exchange": "x",
        "routingKeyColumn": "region",
    } | extra
    writer = orders(spark, 4).write.format("outbox").mode("append")
    writer = writer.options(**{k: v for k, v in options.items() if v is not None})
    with pytest.raises(Exception, match=needle):
        writer.save()
    assert dbview.count(sqlite_url, "outbox") == 0


def test_a_frame_read_twice_is_persisted_only_while_written_and_only_if_not_cached(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sinks, "PERSIST_BETWEEN_PASSES", True)
    df = orders(spark, 4)
    with sinks.persisted(df, passes=1):
        assert not df.is_cached
    with sinks.persisted(df, passes=2):
        assert df.is_cached
    assert not df.is_cached
    df.cache()
    with sinks.persisted(df, passes=2):
        pass
    assert df.is_cached  # the caller's cache is the caller's
    df.unpersist()


def test_sink_refuses_bad_options_at_construction(sqlite_url: str) -> None:
    with pytest.raises(OutboxConfigError, match="exactly one of exchange"):
        OutboxSink(url=sqlite_url, sink="s", routing_key="rk")
