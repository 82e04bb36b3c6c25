"""``sequence_column``: within each ordering key, outbox ids follow the sequence, whatever the
input's partitioning, through all three writers (the publisher publishes a key in id order)."""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_writer import OutboxConfigError, OutboxSchemaError, OutboxSink, write_outbox
from tests.support import dbview

pytestmark = [pytest.mark.spark, pytest.mark.spark_api]

KEYS, PER_KEY = 12, 40


def shuffled_events(spark: SparkSession) -> DataFrame:
    """Events of KEYS accounts, their sequence numbers shuffled and spread over 5 partitions
    (each key's rows in several partitions, out of order in each)."""
    rows = [
        (f"acct-{k}", seq, f'{{"acct": {k}, "seq": {seq}}}')
        for k in range(KEYS)
        for seq in range(PER_KEY)
    ]
    random.Random(7).shuffle(rows)
    df = spark.createDataFrame(rows, "acct string, seq long, payload string")
    return df.repartition(5)


def ids_follow_sequence(url: str, batch_id: str) -> dict[str, list[int]]:
    """Each key's sequence numbers in outbox id order."""
    seqs: dict[str, list[int]] = defaultdict(list)
    for r in dbview.outbox(url):  # id order
        if r["batch_id"] == batch_id:
            seqs[r["ordering_key"]].append(json.loads(r["body"])["seq"])
    return dict(seqs)


def test_write_outbox_lays_each_key_out_in_sequence(spark: SparkSession, db_url: str) -> None:
    df = shuffled_events(spark)
    assert df.rdd.getNumPartitions() == 5
    write_outbox(
        df,
        url=db_url,
        sink="ev",
        batch_id=1,
        exchange="ev",
        routing_key="rk",
        body_column="payload",
        ordering_key_column="acct",
        sequence_column="seq",
    )
    seqs = ids_follow_sequence(db_url, "ev:1")
    assert len(seqs) == KEYS
    assert all(s == list(range(PER_KEY)) for s in seqs.values()), seqs


def test_the_sink_and_the_data_source_follow_the_sequence_too(
    spark: SparkSession, db_url: str
) -> None:
    df = shuffled_events(spark)
    OutboxSink(
        url=db_url,
        sink="fb",
        exchange="ev",
        routing_key="rk",
        body_column="payload",
        ordering_key_column="acct",
        sequence_column="seq",
    )(df, 4)
    # format("outbox"): Spark lays the input out; the task sorts its partition, so the rows of a
    # key must be in one partition (repartition by the key, as docs/spark.md says)
    (
        df.repartition("acct")
        .write.format("outbox")
        .mode("append")
        .options(
            url=db_url,
            sink="ds",
            batchId="4",
            exchange="ev",
            routingKey="rk",
            bodyColumn="payload",
            orderingKeyColumn="acct",
            sequenceColumn="seq",
        )
        .save()
    )
    for batch in ("fb:4", "ds:4"):
        seqs = ids_follow_sequence(db_url, batch)
        assert len(seqs) == KEYS
        assert all(s == list(range(PER_KEY)) for s in seqs.values()), (batch, seqs)


def test_a_sequence_needs_a_key_and_an_orderable_column(spark: SparkSession) -> None:
    with pytest.raises(OutboxConfigError, match="give ordering_key_column too"):
        OutboxSink(
            url="sqlite:///x.db", sink="s", exchange="e", routing_key="r", sequence_column="seq"
        )
    df = shuffled_events(spark).withColumn("seq", F.array(F.col("seq")))
    with pytest.raises(OutboxSchemaError, match="'seq' \\(sequence\\) has type array<bigint>"):
        write_outbox(
            df,
            url="sqlite:///x.db",
            sink="s",
            batch_id=1,
            exchange="e",
            routing_key="r",
            ordering_key_column="acct",
            sequence_column="seq",
        )
