"""Spark-facing writers: ``OutboxSink`` for ``foreachBatch``, ``write_outbox`` for batch jobs.

Each batch runs as: schema check on the driver → one Spark job where every task writes its own
partition in one transaction (nothing is collected on the driver but a small result per task) →
one driver transaction that makes the batch visible and records it in ``outbox_batches``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

from pyspark import TaskContext
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_writer.envelope import BatchRef
from spark_writer.options import DEFAULT_MAX_BODY_BYTES, OnInvalid, OutboxOptions
from spark_writer.validate import check_schema
from spark_writer.writer import (
    BatchResult,
    OnCommitted,
    PartitionResult,
    WritePlan,
    abort_batch,
    batch_recorded,
    commit_batch,
    replayed_result,
    write_partition,
)


class OutboxSink:
    """A ``foreachBatch`` function writing each micro-batch into the outbox exactly once.

    ``df.writeStream.foreachBatch(OutboxSink(url=..., sink="orders", exchange="orders",
    routing_key_column="region")).start()``. ``batch_id`` of the outbox rows is
    ``f"{sink}:{spark_batch_id}"``; a batch id already in ``outbox_batches`` is skipped.
    ``on_partition_committed`` runs in the executor after each partition's commit (for metrics
    or fault injection).
    """

    def __init__(
        self,
        *,
        url: str,
        sink: str,
        exchange: str | None = None,
        exchange_column: str | None = None,
        routing_key: str | None = None,
        routing_key_column: str | None = None,
        body_column: str | None = None,
        content_type: str | None = None,
        header_columns: Sequence[str] = (),
        message_id_column: str | None = None,
        ordering_key_column: str | None = None,
        mandatory: bool = True,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        on_invalid: OnInvalid = "fail",
        on_partition_committed: OnCommitted | None = None,
    ) -> None:
        self.options = OutboxOptions(
            url=url,
            sink=sink,
            exchange=exchange,
            exchange_column=exchange_column,
            routing_key=routing_key,
            routing_key_column=routing_key_column,
            body_column=body_column,
            content_type=content_type,
            header_columns=tuple(header_columns),
            message_id_column=message_id_column,
            ordering_key_column=ordering_key_column,
            mandatory=mandatory,
            max_body_bytes=max_body_bytes,
            on_invalid=on_invalid,
        )
        self.on_partition_committed = on_partition_committed

    def __call__(self, batch_df: DataFrame, batch_id: int) -> BatchResult:
        batch = BatchRef(
            sink=self.options.sink, spark_batch_id=batch_id, query_id=_query_id(batch_df)
        )
        return run_batch(
            batch_df, options=self.options, batch=batch, on_committed=self.on_partition_committed
        )


def write_outbox(
    df: DataFrame,
    *,
    url: str,
    sink: str,
    batch_id: int | None = None,
    exchange: str | None = None,
    exchange_column: str | None = None,
    routing_key: str | None = None,
    routing_key_column: str | None = None,
    body_column: str | None = None,
    content_type: str | None = None,
    header_columns: Sequence[str] = (),
    message_id_column: str | None = None,
    ordering_key_column: str | None = None,
    mandatory: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_invalid: OnInvalid = "fail",
    on_partition_committed: OnCommitted | None = None,
) -> BatchResult:
    """Write a batch DataFrame into the outbox; the options are those of ``OutboxSink``.

    ``batch_id`` names the batch (``f"{sink}:{batch_id}"``). Without it the id is derived from
    the sink name and the DataFrame's content (row count and a sum of row hashes: one extra
    Spark job), so re-running a job over the same input is recognised as a replay and adds
    nothing. Pass ``batch_id`` to skip that job or to send the same rows again on purpose.
    """
    options = OutboxOptions(
        url=url,
        sink=sink,
        exchange=exchange,
        exchange_column=exchange_column,
        routing_key=routing_key,
        routing_key_column=routing_key_column,
        body_column=body_column,
        content_type=content_type,
        header_columns=tuple(header_columns),
        message_id_column=message_id_column,
        ordering_key_column=ordering_key_column,
        mandatory=mandatory,
        max_body_bytes=max_body_bytes,
        on_invalid=on_invalid,
    )
    check_schema(df.schema, options)
    spark_batch_id = batch_id if batch_id is not None else content_batch_id(df, sink)
    batch = BatchRef(sink=sink, spark_batch_id=spark_batch_id)
    return run_batch(df, options=options, batch=batch, on_committed=on_partition_committed)


def run_batch(
    df: DataFrame, *, options: OutboxOptions, batch: BatchRef, on_committed: OnCommitted | None
) -> BatchResult:
    """Check, write every partition from its executor, then commit the batch on the driver."""
    check_schema(df.schema, options)
    if batch_recorded(options=options, batch=batch):
        return replayed_result(batch)
    plan = WritePlan(options=options, schema=df.schema, batch=batch)
    job = partial(_partition_job, plan=plan, on_committed=on_committed)
    try:
        results: list[PartitionResult] = df.rdd.mapPartitionsWithIndex(job).collect()
    except Exception as exc:
        _abort_quietly(exc, options=options, batch=batch)
        raise
    return commit_batch(options=options, batch=batch, results=results)


def content_batch_id(df: DataFrame, sink: str) -> int:
    """A batch id from the sink and the rows (count and a sum of xxhash64 of each row's JSON)."""
    row_hash = F.xxhash64(F.to_json(F.struct(*[df[c] for c in df.columns])))
    first = df.select(
        F.count(F.lit(1)).alias("n"), F.sum(row_hash.cast("decimal(38,0)")).alias("h")
    ).first()
    assert first is not None
    digest = hashlib.sha256(f"{sink}|{first['n']}|{first['h']}".encode()).hexdigest()
    return int(digest[:15], 16)


def _partition_job(
    index: int, rows: Iterable[Any], *, plan: WritePlan, on_committed: OnCommitted | None
) -> Iterator[PartitionResult]:
    context = TaskContext.get()
    attempt = context.attemptNumber() if context is not None else 0
    yield write_partition(
        rows, plan=plan, partition=index, attempt=attempt, on_committed=on_committed
    )


def _abort_quietly(exc: Exception, *, options: OutboxOptions, batch: BatchRef) -> None:
    try:
        abort_batch(options=options, batch=batch)
    except Exception as cleanup:  # keep the job's own error first
        exc.add_note(f"removing the parked rows of {batch.key} failed too: {cleanup!r}")


def _query_id(df: DataFrame) -> str | None:
    try:
        return df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:  # Spark Connect has no SparkContext; the id is then unknown
        return None
