"""The Spark writers into a RabbitMQ stream, end to end: a real local SparkSession writes rows
naming a stream (``stream`` or ``stream_column``), the publisher drains them through its stream
relay, and the stream, read whole from its first offset, holds every message id exactly once.
Bad stream names in a column are that row's problem only, as bad routing keys are."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType

from app.publisher.service import run_publisher
from spark_writer import (
    OutboxConfigError,
    OutboxDataError,
    OutboxSink,
    write_outbox,
)
from tests.support import dbview
from tests.support.publisher import settings_for
from tests.support.streams import delete_stream, new_stream, read_stream

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]

ROWS = StructType(
    [
        StructField("key", StringType()),
        StructField("target", StringType()),
        StructField("payload", StringType()),
        StructField("n", LongType()),
    ]
)


@pytest.fixture
def streams(stream_url: str) -> Iterator[list[str]]:
    """Two streams of this test's own."""
    names = [new_stream(stream_url, prefix="spark"), new_stream(stream_url, prefix="spark")]
    yield names
    for name in names:
        delete_stream(stream_url, name)


def frame(spark: SparkSession, prefix: str, targets: list[str | None]) -> DataFrame:
    """One row per target, ``key`` ``{prefix}{i}``, in two partitions."""
    rows = [(f"{prefix}{i}", t, f"{prefix} body {i}", i) for i, t in enumerate(targets)]
    return spark.createDataFrame(rows, ROWS).coalesce(2)


def drain(db_url: str, amqp_url: str, stream_url: str) -> None:
    settings = settings_for(db_url=db_url, amqp_url=amqp_url, stream_url=stream_url)
    asyncio.run(run_publisher(settings, until_empty=True))


def outbox_ids(db_url: str, stream: str) -> set[str]:
    """The ids the writers put in the outbox for ``stream``, as the publisher reads them."""
    rows = dbview.query(
        db_url,
        "SELECT message_id, exchange, routing_key, ordering_key, stream FROM outbox "
        f"WHERE stream = '{stream}'",
    )
    assert {(r["exchange"], r["routing_key"], r["ordering_key"]) for r in rows} <= {("", "", None)}
    return {r["message_id"] for r in rows}


def exactly_once(stream_url: str, expected: dict[str, set[str]]) -> None:
    """Each stream, read whole from its first offset (all at once: each read waits a second
    after its last message for a duplicate), holds each of its ids once, none missing."""
    with ThreadPoolExecutor(len(expected)) as pool:
        reads = {
            name: pool.submit(read_stream, stream_url, name, expect=len(ids))
            for name, ids in expected.items()
        }
    for name, ids in expected.items():
        got = reads[name].result()
        assert got.duplicates() == {}, name
        assert got.missing(ids) == set(), name
        assert len(got.ids) == len(ids), name


def test_every_writer_appends_each_row_to_the_stream_exactly_once(
    spark: SparkSession, db_url: str, amqp_url: str, stream_url: str, streams: list[str]
) -> None:
    first, second = streams
    # write_outbox, a literal stream, keyed rows; a re-run of the batch is a replay
    batch = frame(spark, "b", [None] * 40)
    options: dict[str, Any] = {"url": db_url, "body_column": "payload"}
    written = write_outbox(
        batch, sink="sb", batch_id=1, stream=first, message_id_column="key", **options
    )
    assert (written.rows, written.written) == (40, 40)
    assert write_outbox(
        batch, sink="sb", batch_id=1, stream=first, message_id_column="key", **options
    ).replayed

    # OutboxSink (foreachBatch), a stream per row, ids from the content; batch 5 runs again
    # after the driver "died" between writing its rows and recording it: same ids, no conflict
    sink = OutboxSink(sink="sf", stream_column="target", **options)
    micro = frame(spark, "f", [first if i % 2 else second for i in range(30)])
    assert sink(micro, 5).written == 30
    dbview.execute(db_url, "DELETE FROM outbox_batches WHERE batch_id = 'sf:5'")
    replay = sink(micro, 5)
    assert (replay.replayed, replay.written, replay.duplicates, replay.rejected) == (
        False,
        0,
        30,
        0,
    )
    assert sink(micro, 5).replayed

    # format("outbox"), streamColumn
    (
        frame(spark, "d", [second] * 20)
        .write.format("outbox")
        .mode("append")
        .options(url=db_url, sink="sd", batchId="2", streamColumn="target", bodyColumn="payload")
        .option("messageIdColumn", "key")
        .save()
    )

    expected = {first: outbox_ids(db_url, first), second: outbox_ids(db_url, second)}
    assert [len(expected[first]), len(expected[second])] == [40 + 15, 15 + 20]
    drain(db_url, amqp_url, stream_url)
    statuses = dbview.query(db_url, "SELECT status, count(*) AS n FROM outbox GROUP BY status")
    assert {r["status"]: r["n"] for r in statuses} == {"confirmed": 90}
    exactly_once(stream_url, expected)


BAD = {
    3: (None, "target is null"),
    7: ("", "target is empty"),
    11: ("s" * 256, "target is 256 bytes, over the 255-byte limit"),
    13: ("line\nbreak", "target 'line\\nbreak' holds a control character"),
    17: ("amq.orders", "target is 'amq.orders': names starting 'amq.' are reserved"),
}


def test_a_bad_stream_in_a_column_rejects_that_row_and_delivers_the_others(
    spark: SparkSession, pg_url: str, amqp_url: str, stream_url: str, streams: list[str]
) -> None:
    targets: list[str | None] = [streams[i % 2] for i in range(24)]
    for i, (value, _) in BAD.items():
        targets[i] = value
    df = frame(spark, "r", targets)
    options: dict[str, Any] = {
        "url": pg_url,
        "sink": "sr",
        "stream_column": "target",
        "body_column": "payload",
    }
    with pytest.raises(OutboxDataError) as failed:  # fail mode: nothing written
        OutboxSink(message_id_column="key", **options)(df, 1)
    assert {p.summary: p.rows for p in failed.value.problems} == {
        "column 'target' (stream) is null": 1,
        "column 'target' (stream) is empty": 1,
        "column 'target' (stream) is longer than 255 bytes": 1,
        "column 'target' (stream) holds a control character": 1,
        "column 'target' (stream) starts with 'amq.', a reserved prefix": 1,
    }
    assert dbview.counts(pg_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}

    result = OutboxSink(message_id_column="key", on_invalid="reject", **options)(df, 1)
    assert (result.rows, result.written, result.rejected) == (24, 19, 5)
    rejects = {r["message_id"]: r["reason"] for r in dbview.rejects(pg_url)}
    assert rejects == {f"r{i}": reason for i, (_, reason) in BAD.items()}

    drain(pg_url, amqp_url, stream_url)
    want = {
        name: {f"r{i}" for i in range(24) if i % 2 == n and i not in BAD}
        for n, name in enumerate(streams)
    }
    assert {name: outbox_ids(pg_url, name) for name in streams} == want
    exactly_once(stream_url, want)


def test_a_message_id_held_for_another_stream_is_a_conflict(
    spark: SparkSession, sqlite_url: str
) -> None:
    df = frame(spark, "c", ["one"] * 6)
    options: dict[str, Any] = {
        "url": sqlite_url,
        "body_column": "payload",
        "message_id_column": "key",
    }
    write_outbox(df, sink="c1", batch_id=1, stream="one", **options)
    moved = write_outbox(df, sink="c1", batch_id=2, stream="two", on_invalid="reject", **options)
    assert (moved.written, moved.conflicts) == (0, 6)
    assert {r["reason"].split(" (")[0] for r in dbview.rejects(sqlite_url)} == {
        f"message id 'c{i}' is held by a row of batch c1:1 with another stream" for i in range(6)
    }


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"stream": "s", "exchange": "x"}, "to an exchange or to a stream, not both"),
        ({"stream_column": "target", "routing_key": "k"}, "not both"),
        ({"stream": "s", "stream_column": "target"}, "exactly one of stream and stream_column"),
        ({"stream": "s", "ordering_key_column": "key"}, "a stream keeps its messages in order"),
        ({"stream": "amq.s"}, "names starting 'amq.' are reserved"),
        ({"body_column": "payload"}, "give a destination"),
    ],
)
def test_the_batch_writers_refuse_bad_stream_options_before_any_job(
    spark: SparkSession, sqlite_url: str, kw: dict[str, Any], needle: str
) -> None:
    with pytest.raises(OutboxConfigError, match=needle):
        OutboxSink(url=sqlite_url, sink="o", **kw)
    with pytest.raises(OutboxConfigError, match=needle):
        write_outbox(frame(spark, "o", ["s"] * 2), url=sqlite_url, sink="o", batch_id=1, **kw)
    assert dbview.counts(sqlite_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}


def test_the_data_source_refuses_bad_stream_options(spark: SparkSession, sqlite_url: str) -> None:
    df = frame(spark, "o", ["s"] * 2)
    cases = {
        "to an exchange or to a stream, not both": {"exchange": "x", "routingKey": "k"},
        "a stream keeps its messages in order by itself": {"orderingKeyColumn": "key"},
    }
    for needle, extra in cases.items():
        writer = df.write.format("outbox").mode("append")
        with pytest.raises(Exception, match=needle):
            writer.options(url=sqlite_url, sink="o", batchId="1", stream="s", **extra).save()
    assert dbview.counts(sqlite_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}
