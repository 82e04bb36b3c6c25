"""``format("outbox")`` without ``messageIdColumn`` names rows by content, not position: a batch
replayed with another layout (other partitions, other order) after only part of it committed
ends with every distinct row exactly once."""

from __future__ import annotations

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from tests.support import dbview
from tests.support.spark import orders

pytestmark = [pytest.mark.spark, pytest.mark.spark_api]


def save(df: DataFrame, url: str) -> None:
    (
        df.write.format("outbox")
        .mode("append")
        .options(url=url, sink="ds", batchId="5", exchange="x", routingKeyColumn="region")
        .option("onInvalid", "reject")  # no parking: a partition's rows are due at its commit
        .save()
    )


def test_a_replay_laid_out_otherwise_adds_nothing_and_drops_nothing(
    spark: SparkSession, db_url: str
) -> None:
    # writes through format("outbox") (save above): skipped where PySpark lacks it
    df = orders(spark, 60)  # two partitions of 30
    save(df, db_url)
    first = {r["message_id"]: r["body"] for r in dbview.outbox(db_url)}
    assert len(first) == 60
    # as if the driver died after one partition committed: the batch unrecorded, half the rows
    dbview.execute(db_url, "DELETE FROM outbox_batches")
    dbview.execute(db_url, "DELETE FROM outbox WHERE id % 2 = 0")
    assert dbview.count(db_url, "outbox") == 30

    save(df.repartition(3).orderBy(F.rand(seed=7)), db_url)  # other partitions, other order
    again = {r["message_id"]: r["body"] for r in dbview.outbox(db_url)}
    assert again == first  # the same 60 ids for the same 60 rows, none twice
    assert dbview.count(db_url, "outbox") == 60
    assert [b["row_count"] for b in dbview.batches(db_url)] == [60]
