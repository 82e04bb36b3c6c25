"""``df.write.format("outbox")`` and ``df.writeStream.format("outbox")``: a PySpark Python data
source with the same options as ``OutboxSink`` (camelCase or snake_case, any case).

Register it once per session with ``register_data_source(spark)``. Batch writes take ``batchId``
(the data source gets no Spark batch id); streaming writes use Spark's micro-batch id. Tasks get
Arrow record batches and write them with ``write_partition``, like ``OutboxSink``.

The data source sees the options and the schema on the driver, never the rows: those are checked
in each task. In fail mode (the default) the tasks therefore write their rows *parked* (never
due): when every partition is clean, ``commit`` releases them in the transaction that records the
batch; when any row is bad (or its id conflicts), ``commit`` removes them and fails, and
``abort`` (a failed job) removes them too. So a batch with one bad row publishes nothing. The
price is one more write of each row on release, paid only here: ``OutboxSink`` and
``write_outbox`` hold the batch from the driver before their tasks write (one row in
``outbox_held``), which a streaming data source cannot (Spark gives its driver no hook before a
micro-batch's tasks); reject mode needs neither.

With option ``wait`` = ``confirmed`` (and ``waitTimeout``, seconds), ``commit`` waits until the
broker settled the batch's rows and fails the write (the job, or the streaming query) naming
the batch and the counts when a row was not confirmed. The batch stays recorded: Spark's
``abort`` after the failed commit finds nothing to remove.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from spark_writer.envelope import BatchRef
from spark_writer.errors import OutboxConfigError
from spark_writer.options import OutboxOptions, from_spark_options
from spark_writer.validate import check_schema
from spark_writer.writer import (
    PartitionResult,
    WritePlan,
    commit_batch,
    delivered,
    discard_unrecorded,
    log,
    write_partition,
)

#: Local properties Spark sets on the tasks of a micro-batch.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


def register_data_source(spark: SparkSession) -> None:
    """Make ``format("outbox")`` available in this session."""
    spark.dataSource.register(OutboxDataSource)


class OutboxDataSource(DataSource):
    """The ``outbox`` format. Append only: ``mode("overwrite")`` is refused."""

    @classmethod
    def name(cls) -> str:
        return "outbox"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        options, batch_id = self._checked(schema, overwrite)
        if batch_id is None:
            if options.message_id_column is None:
                raise OutboxConfigError(
                    "a batch write needs option batchId (or messageIdColumn), so that running "
                    "the same job again is recognised and adds no rows"
                )
            batch_id = int(time.time() * 1000)  # a label only: the key column makes ids stable
        batch = BatchRef(sink=options.sink, spark_batch_id=batch_id)
        park = options.on_invalid == "fail"
        return OutboxBatchWriter(
            WritePlan(options=options, schema=schema, batch=batch, sort_in_task=True, park=park)
        )

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        options, batch_id = self._checked(schema, overwrite)
        if batch_id is not None:
            raise OutboxConfigError("batchId is for batch writes; a stream uses Spark's batch ids")
        return OutboxStreamWriter(options=options, schema=schema)

    def _checked(self, schema: StructType, overwrite: bool) -> tuple[OutboxOptions, int | None]:
        if overwrite:
            raise OutboxConfigError("the outbox only appends: use mode('append')")
        options, batch_id = from_spark_options(dict(self.options))
        check_schema(schema, options)
        return options, batch_id


def _driver_log() -> None:
    """Spark runs a data source's ``commit`` in a Python worker on the driver, where nobody
    configures logging: give the writer's logger a stderr handler there (once), so its line per
    batch reaches the driver's log like ``OutboxSink``'s. Left alone when logging is set up."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


class PartitionDone(WriterCommitMessage):
    """A task's commit message: what it wrote, for which batch."""

    def __init__(self, *, batch: BatchRef, result: PartitionResult) -> None:
        self.batch = batch
        self.result = result


def _results(messages: Sequence[WriterCommitMessage | None]) -> list[PartitionResult]:
    return [m.result for m in messages if isinstance(m, PartitionDone)]


def _task() -> tuple[int, int]:
    context = TaskContext.get()
    assert context is not None, "outbox writers run inside Spark tasks"
    return context.partitionId(), context.attemptNumber()


class OutboxBatchWriter(DataSourceArrowWriter):
    """``df.write.format("outbox")``: one transaction per task, the batch recorded on commit."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        partition, attempt = _task()
        result = write_partition(iterator, plan=self.plan, partition=partition, attempt=attempt)
        return PartitionDone(batch=self.plan.batch, result=result)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _driver_log()
        plan = self.plan
        result = commit_batch(
            options=plan.options, batch=plan.batch, results=_results(messages), parked=plan.park
        )
        delivered(result, options=plan.options)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        if self.plan.park:
            discard_unrecorded(options=self.plan.options, batch=self.plan.batch)


class OutboxStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("outbox")``: each micro-batch id is written exactly once."""

    def __init__(self, *, options: OutboxOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self.park = options.on_invalid == "fail"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        partition, attempt = _task()
        batch = self._task_batch()
        plan = WritePlan(
            options=self.options,
            schema=self.schema,
            batch=batch,
            sort_in_task=True,
            park=self.park,
        )
        result = write_partition(iterator, plan=plan, partition=partition, attempt=attempt)
        return PartitionDone(batch=batch, result=result)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _driver_log()
        batch = self._batch(messages, batchId)
        results = _results(messages)
        result = commit_batch(options=self.options, batch=batch, results=results, parked=self.park)
        delivered(result, options=self.options)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if self.park:
            discard_unrecorded(options=self.options, batch=self._batch(messages, batchId))

    def _task_batch(self) -> BatchRef:
        context = TaskContext.get()
        batch_id = context.getLocalProperty(BATCH_ID_PROPERTY) if context else None
        if batch_id is None:
            raise RuntimeError(f"Spark did not set {BATCH_ID_PROPERTY} on this streaming task")
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY) if context else None
        return BatchRef(sink=self.options.sink, spark_batch_id=int(batch_id), query_id=query_id)

    def _batch(self, messages: Sequence[Any], batch_id: int) -> BatchRef:
        seen = {m.batch for m in messages if isinstance(m, PartitionDone)}
        for batch in seen:
            if batch.spark_batch_id != batch_id:
                raise RuntimeError(f"task wrote batch {batch.key}, Spark commits {batch_id}")
        query_id = next((b.query_id for b in seen), None)
        return BatchRef(sink=self.options.sink, spark_batch_id=batch_id, query_id=query_id)
