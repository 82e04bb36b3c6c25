"""PostgreSQL partitions are written in segments held in memory, never spooled to the executor's
disk: each segment is COPYed under a savepoint, and a segment meeting an id already there goes
through the staging table, as does the rest of the partition. One transaction either way.

Driven through ``write_partition`` (the function every Spark task runs) in this process, with
segments of one Arrow batch each, so a 300-row partition spans 15 segments.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from spark_writer import OutboxOptions
from spark_writer.db import PostgresStore
from spark_writer.envelope import BatchRef
from spark_writer.writer import WritePlan, write_partition
from tests.support import dbview

pytestmark = pytest.mark.spark

SCHEMA = StructType([StructField("id", LongType()), StructField("payload", StringType())])


def batches(ids: range, *, size: int = 20, body: str = "row") -> Iterator[pa.RecordBatch]:
    for start in range(ids.start, ids.stop, size):
        chunk = range(start, min(start + size, ids.stop))
        yield pa.RecordBatch.from_pydict(
            {"id": list(chunk), "payload": [f"{body} {i}" for i in chunk]}
        )


def plan(url: str, *, sink: str = "seg", on_invalid: str = "fail") -> WritePlan:
    options = OutboxOptions(
        url=url,
        sink=sink,
        exchange="x",
        routing_key="rk",
        body_column="payload",
        message_id_column="id",
        on_invalid=on_invalid,
    )  # type: ignore[arg-type]
    return WritePlan(options=options, schema=SCHEMA, batch=BatchRef(sink=sink, spark_batch_id=1))


@pytest.fixture(autouse=True)
def tiny_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PostgresStore, "SEGMENT_BYTES", 1)  # every Arrow batch a segment


def test_a_replayed_middle_is_staged_and_every_row_lands_once_in_order(pg_url: str) -> None:
    first = write_partition(batches(range(100, 120)), plan=plan(pg_url), partition=0, attempt=0)
    assert first.inserted == 20
    result = write_partition(batches(range(300)), plan=plan(pg_url), partition=0, attempt=0)
    assert (result.rows, result.inserted, result.conflicts) == (300, 280, 0)
    ids = [int(r["message_id"]) for r in dbview.outbox(pg_url)]  # in outbox id order
    assert sorted(ids) == list(range(300))
    assert ids[20:] == [i for i in range(300) if not 100 <= i < 120]  # the partition's order


def test_a_conflict_in_a_middle_segment(pg_url: str) -> None:
    other = write_partition(
        batches(range(150, 151), body="other"), plan=plan(pg_url, sink="b"), partition=0, attempt=0
    )
    assert other.inserted == 1
    # fail mode: the whole partition rolls back, the segments COPYed before it included
    failed = write_partition(batches(range(300)), plan=plan(pg_url), partition=0, attempt=0)
    assert (failed.inserted, failed.conflicts, failed.invalid) == (0, 1, 1)
    assert dbview.count(pg_url, "outbox") == 1
    # reject mode: the conflicting row is rejected, the 299 others written
    ok = write_partition(
        batches(range(300)), plan=plan(pg_url, on_invalid="reject"), partition=0, attempt=0
    )
    assert (ok.inserted, ok.conflicts, ok.rejected) == (299, 1, 1)
    assert [r["message_id"] for r in dbview.rejects(pg_url)] == ["150"]
    assert dbview.count(pg_url, "outbox") == 300
