"""Fail mode reads the input once: each task checks the rows it writes, into a *held* batch.

``OutboxSink`` and ``write_outbox`` in fail mode hold the batch (one row in ``outbox_held``)
from the driver before their tasks write. A publisher claims no row of a held batch, so the
partitions that commit before another partition finds a bad row are never published; the
driver's commit records the batch and lifts the hold in one transaction, or removes the
batch's rows when it failed. The rows are written by the product's own task and driver
functions (``write_partition``, ``commit_batch``) and claimed by the publisher's own
``OutboxClients.claim``; the streaming tests run the real ``OutboxSink`` and read Spark's own
``StreamingQueryProgress``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType
from sqlalchemy import make_url

from app.cli import main
from app.db import make_engine
from app.outbox.planner import CLAIM_REWALK
from spark_writer import OutboxDataError, OutboxOptions, OutboxSink, write_outbox
from spark_writer.envelope import BatchRef
from spark_writer.writer import WritePlan, commit_batch, hold_batch, write_partition
from tests.support import dbview
from tests.support.outbox_clients import OutboxClients
from tests.support.spark import (
    ORDERS,
    await_stream,
    fail_on_row_25,
    orders,
    sink_options,
    write_order_files,
)

pytestmark = pytest.mark.spark

SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("payload", StringType()),
    ]
)


def options_for(url: str, **kw: object) -> OutboxOptions:
    base: dict[str, object] = {
        "url": url,
        "sink": "held",
        "exchange": "x",
        "routing_key_column": "region",
        "body_column": "payload",
        "message_id_column": "id",
    }
    return OutboxOptions(**(base | kw))  # type: ignore[arg-type]


def rows(ids: list[int], *, payload: str = "p", region: str = "eu") -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"id": ids, "region": [region] * len(ids), "payload": [f"{payload}{i}" for i in ids]}
    )


@pytest.fixture
def repo(db_url: str) -> Iterator[OutboxClients]:
    engine = make_engine(db_url)
    yield OutboxClients(engine)
    engine.dispose()


@pytest.fixture
def status_json(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[[], dict[str, Any]]]:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", db_url)

    def read() -> dict[str, Any]:
        assert main(["status", "--json"]) in (0, 1)
        body: dict[str, Any] = json.loads(capsys.readouterr().out)
        return body

    yield read


def claimed_ids(repo: OutboxClients) -> list[str]:
    return [r.message_id for r in repo.store.claim(owner="pub", limit=100, lease_seconds=30)]


def test_a_held_batch_is_not_published_until_recorded_and_counts_as_parked(
    db_url: str, repo: OutboxClients, status_json: Callable[[], dict[str, Any]]
) -> None:
    options = options_for(db_url)
    batch = BatchRef(sink="held", spark_batch_id=1)
    hold_batch(options=options, batch=batch)
    plan = WritePlan(options=options, schema=SCHEMA, batch=batch)
    first = write_partition([rows([1, 2])], plan=plan, partition=0, attempt=0)
    second = write_partition([rows([3])], plan=plan, partition=1, attempt=0)
    assert (first.inserted, second.inserted) == (2, 1)  # committed, and held
    # another sink's batch, not held, flows past it
    other = options_for(db_url, sink="free", message_id_column="id")
    free = BatchRef(sink="free", spark_batch_id=1)
    free_plan = WritePlan(options=other, schema=SCHEMA, batch=free)
    write_partition([rows([100], payload="f")], plan=free_plan, partition=0, attempt=0)

    assert claimed_ids(repo) == ["100"]
    stats = status_json()
    assert (stats["parked"], stats["counts"]["pending"]) == (3, 3)
    assert stats["oldest_pending_age_seconds"] is None  # held rows do not wait for a publisher

    result = commit_batch(options=options, batch=batch, results=[first, second], held=True)
    assert (result.rows, result.written, result.replayed) == (3, 3, False)
    # the writer lifted the hold: the rows sort behind the claim's floor (they were written
    # before row 100), so the publisher's next walk from the start takes them
    time.sleep(CLAIM_REWALK.total_seconds())
    assert sorted(claimed_ids(repo)) == ["1", "2", "3"]
    assert dbview.count(db_url, "outbox_held") == 0
    assert status_json()["parked"] == 0


def test_a_held_head_holds_its_ordering_key_back(db_url: str, repo: OutboxClients) -> None:
    keyed = options_for(db_url, ordering_key_column="region")
    held = BatchRef(sink="held", spark_batch_id=1)
    hold_batch(options=keyed, batch=held)
    done = write_partition(
        [rows([1], region="k")],
        partition=0,
        attempt=0,
        plan=WritePlan(options=keyed, schema=SCHEMA, batch=held),
    )
    later = BatchRef(sink="held", spark_batch_id=2)  # the key's next row, in a batch not held
    write_partition(
        [rows([2], region="k")],
        partition=0,
        attempt=0,
        plan=WritePlan(options=keyed, schema=SCHEMA, batch=later),
    )
    assert claimed_ids(repo) == []  # neither the held head nor the row behind it
    commit_batch(options=keyed, batch=held, results=[done], held=True)
    assert claimed_ids(repo) == ["1"]  # the head first; "2" once "1" is confirmed


def test_a_failed_held_batch_leaves_nothing_and_a_late_task_publishes_nothing(
    db_url: str, repo: OutboxClients, status_json: Callable[[], dict[str, Any]]
) -> None:
    options = options_for(db_url)
    batch = BatchRef(sink="held", spark_batch_id=5)
    hold_batch(options=options, batch=batch)
    plan = WritePlan(options=options, schema=SCHEMA, batch=batch)
    good = write_partition([rows([1, 2])], plan=plan, partition=0, attempt=0)
    bad_rows = pa.RecordBatch.from_arrays(
        [pa.array([3]), pa.array([None], pa.string()), pa.array(["p3"])],
        ["id", "region", "payload"],
    )
    bad = write_partition([bad_rows], plan=plan, partition=1, attempt=0)
    assert (good.inserted, bad.inserted, bad.invalid) == (2, 0, 1)
    assert dbview.count(db_url, "outbox") == 2  # partition 0 committed, held

    with pytest.raises(OutboxDataError) as err:
        commit_batch(options=options, batch=batch, results=[good, bad], held=True)
    assert "batch held:5: 1 invalid row(s), nothing written" in str(err.value)
    assert "column 'region' (routing key) is null: 1 row(s)" in str(err.value)
    assert dbview.counts(db_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}

    # a speculative attempt of partition 0 that commits after the driver gave up: still held
    write_partition([rows([1, 2])], plan=plan, partition=0, attempt=1)
    assert claimed_ids(repo) == []
    assert status_json()["parked"] == 2
    # the fixed re-run of the batch writes what is missing and releases all of it
    hold_batch(options=options, batch=batch)
    fixed = [
        write_partition([rows([1, 2])], plan=plan, partition=0, attempt=0),
        write_partition([rows([3])], plan=plan, partition=1, attempt=0),
    ]
    result = commit_batch(options=options, batch=batch, results=fixed, held=True)
    assert (result.written, result.duplicates) == (1, 2)
    assert sorted(claimed_ids(repo)) == ["1", "2", "3"]


@pytest.mark.spark_api
@pytest.mark.parametrize("key", [None, "id"], ids=["derived-ids", "key-column"])
def test_fail_mode_reads_each_micro_batch_once(
    spark: SparkSession, pg_url: str, tmp_path: Path, key: str | None
) -> None:
    """``numInputRows`` in Spark's progress equals the rows of each micro-batch (a check pass
    before the write used to read every batch twice: a Kafka source would be fetched twice)."""
    docs = write_order_files(tmp_path / "in", files=3, per_file=40)
    sink = OutboxSink(
        url=pg_url, sink="once", exchange="x", routing_key_column="region", message_id_column=key
    )
    query = (
        spark.readStream.schema(ORDERS)
        .option("maxFilesPerTrigger", 1)
        .json(str(tmp_path / "in"))
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    await_stream(query)
    assert [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]] == [40] * 3
    # what Spark's progress cannot carry for a foreachBatch sink, the sink object sums up
    assert sink.last_result is not None and sink.last_result.rows == 40
    totals = sink.totals
    assert (totals.batches, totals.rows, totals.written, totals.rejected) == (3, 120, 120, 0)
    assert dbview.count(pg_url, "outbox") == len(docs)
    assert [b["row_count"] for b in dbview.batches(pg_url)] == [40] * 3
    assert dbview.count(pg_url, "outbox_held") == 0


@pytest.mark.spark_api
def test_fail_mode_stream_with_a_bad_row_publishes_nothing_of_its_batch(
    spark: SparkSession, pg_url: str, tmp_path: Path
) -> None:
    docs = write_order_files(tmp_path / "in", files=1, per_file=30)
    docs[17]["region"] = None  # one bad row among 30, in one of the batch's partitions
    (tmp_path / "in" / "part-000.json").write_text("\n".join(json.dumps(d) for d in docs))
    sink = OutboxSink(
        url=pg_url, sink="bad", exchange="x", routing_key_column="region", message_id_column="id"
    )
    query = (
        spark.readStream.schema(ORDERS)
        .json(str(tmp_path / "in"))
        .repartition(2)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(Exception) as caught:
        query.awaitTermination(120)
    error = str(caught.value)
    assert "batch bad:0: 1 invalid row(s), nothing written" in error
    assert "column 'region' (routing key) is null: 1 row(s), first:" in error
    assert "message id 17" in error
    assert dbview.counts(pg_url) == {"outbox": 0, "outbox_batches": 0, "outbox_rejects": 0}
    engine = make_engine(pg_url)
    assert claimed_ids(OutboxClients(engine)) == []
    engine.dispose()


def test_a_held_insert_wakes_no_publisher_and_lifting_the_hold_does(pg_url: str) -> None:
    """PostgreSQL: a publisher woken by a held batch's insert would only walk past rows it may
    not take; the commit that lifts the hold wakes it instead."""
    conninfo = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as listener:
        listener.execute("LISTEN outbox_new")
        options = options_for(pg_url)
        batch = BatchRef(sink="held", spark_batch_id=9)
        hold_batch(options=options, batch=batch)
        plan = WritePlan(options=options, schema=SCHEMA, batch=batch, held=True)
        done = write_partition([rows([1, 2])], plan=plan, partition=0, attempt=0)
        assert done.inserted == 2
        assert list(listener.notifies(timeout=0.5)) == []
        free = BatchRef(sink="held", spark_batch_id=10)  # a batch not held still wakes them
        write_partition(
            [rows([3])],
            partition=0,
            attempt=0,
            plan=WritePlan(options=options, schema=SCHEMA, batch=free),
        )
        assert [n.channel for n in listener.notifies(timeout=2, stop_after=1)] == ["outbox_new"]
        commit_batch(options=options, batch=batch, results=[done], held=True)
        assert [n.channel for n in listener.notifies(timeout=2, stop_after=1)] == ["outbox_new"]


@pytest.mark.spark_api
def test_a_failed_write_job_publishes_nothing_and_its_rerun_releases_every_row(
    spark: SparkSession, db_url: str, repo: OutboxClients, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a bad value but a task that fails (here a UDF on row 25, both attempts): the job
    fails, the driver removes what the other partition committed into the held batch, and a
    partition committing after that stays held; the fixed re-run writes and releases all."""
    df = orders(spark, 30)
    fails_on_row_25 = F.udf(lambda payload: fail_on_row_25(payload), StringType())
    broken = df.withColumn("payload", fails_on_row_25("payload"))
    with (
        caplog.at_level(logging.WARNING, logger="spark_writer"),
        pytest.raises(Exception, match="row 25 cannot be computed"),
    ):
        write_outbox(broken, batch_id=4, **sink_options(db_url))
    assert "outbox batch orders:4: write failed; removed the" in caplog.text
    assert claimed_ids(repo) == []  # whatever partition 0 committed, before or after the removal
    assert dbview.count(db_url, "outbox_batches") == 0
    assert [h["batch_id"] for h in dbview.query(db_url, "SELECT batch_id FROM outbox_held")] == [
        "orders:4"
    ]

    result = write_outbox(df, batch_id=4, **sink_options(db_url))
    assert (result.rows, result.written + result.duplicates) == (30, 30)
    assert dbview.count(db_url, "outbox_held") == 0
    assert len(claimed_ids(repo)) == 30
