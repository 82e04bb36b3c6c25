"""Spark-facing writers: ``OutboxSink`` for ``foreachBatch``, ``write_outbox`` for batch jobs.

Each batch runs as: schema check on the driver → (fail mode) the batch *held* (one row in
``outbox_held``: no publisher claims its rows yet) → one Spark job where every task checks and
writes its own partition in one transaction from Arrow batches, as the ``format("outbox")`` data
source does (the same ``write_partition``): the input is read once → one driver transaction
recording the batch in ``outbox_batches`` and lifting the hold; or, when a task found a bad row
in fail mode (its partition wrote nothing), the batch's rows removed and an error naming every
problem. Only a small result per task travels back to the driver.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from spark_writer.delivery import BatchResult
from spark_writer.envelope import DIGEST, OCCURRENCE, BatchRef
from spark_writer.errors import OutboxDeliveryError
from spark_writer.options import OutboxOptions, options_of
from spark_writer.progress import OutboxProgress
from spark_writer.validate import check_schema
from spark_writer.writer import (
    OnCommitted,
    PartitionResult,
    WritePlan,
    batch_recorded,
    commit_batch,
    delivered,
    discard_unrecorded,
    hold_batch,
    log,
    replayed_result,
    write_partition,
)

#: Persist a DataFrame read twice (``write_outbox`` deriving the batch id from the content,
#: then the write) unless it is cached. Off: for the plans the benchmark writes (a file source,
#: a generated plan), building the cache costs more than reading the batch again. Persist an
#: expensive plan yourself before the call, or pass ``batch_id``.
PERSIST_BETWEEN_PASSES = False


class OutboxSink:
    """A ``foreachBatch`` function writing each micro-batch into the outbox exactly once.

    ``df.writeStream.foreachBatch(OutboxSink(url=..., sink="orders", exchange="orders",
    routing_key_column="region")).start()``. ``batch_id`` of the outbox rows is
    ``f"{sink}:{spark_batch_id}"``; a batch id already in ``outbox_batches`` is skipped.
    The options are one :class:`~spark_writer.options.OutboxOptions` (where each is
    described), or its fields as keywords, among them the message per row
    (``headers_column``, ``content_type_column``, ``property_columns``, ``persistent``),
    ``max_connections`` and ``password_file``.
    ``on_partition_committed`` runs in the executor after each partition's commit (for metrics
    or fault injection).
    """

    def __init__(
        self,
        options: OutboxOptions | None = None,
        /,
        *,
        on_partition_committed: OnCommitted | None = None,
        **fields: Any,
    ) -> None:
        self.options = options_of(options, fields)
        self.on_partition_committed = on_partition_committed
        #: what the last batch did, and the sums over every batch this sink object wrote
        #: (Spark's progress cannot carry them: see ``SinkTotals``)
        self.last_result: BatchResult | None = None
        self.totals = SinkTotals()
        #: ``spark.streams.addListener(sink.progress)``: each micro-batch's Spark progress with
        #: what the outbox did (``progress.OutboxProgress``)
        self.progress = OutboxProgress(
            url=self.options.url,
            sink=self.options.sink,
            password_file=self.options.password_file,
        )

    def __call__(self, batch_df: DataFrame, batch_id: int) -> BatchResult:
        batch = BatchRef(
            sink=self.options.sink, spark_batch_id=batch_id, query_id=_query_id(batch_df)
        )
        try:
            result = run_batch(
                batch_df,
                options=self.options,
                batch=batch,
                on_committed=self.on_partition_committed,
                stopped=_query_stopped(batch_df, batch.query_id),
            )
        except OutboxDeliveryError as error:  # written and recorded, not delivered
            if error.result is not None:
                self._done(batch, error.result)
            raise
        self._done(batch, result)
        return result

    def _done(self, batch: BatchRef, result: BatchResult) -> None:
        self.last_result = result
        self.totals.add(result)
        self.progress.record(batch.query_id, result, batch.spark_batch_id)


@dataclass
class SinkTotals:
    """Sums of the ``BatchResult`` of every batch one ``OutboxSink`` wrote (driver side).

    Spark reports a ``foreachBatch`` sink's ``numOutputRows`` as -1 and collects no metric a
    ``foreachBatch`` function observes (``observe()`` inside the function reaches no
    ``StreamingQueryProgress``: tried on PySpark 4.x), so what the writer did is here, per
    micro-batch beside Spark's progress in ``sink.progress`` (a listener), in the driver's log
    line per batch, and in ``outbox batches``. The delivery figures count with
    ``wait="confirmed"`` only: the rows as the wait left them.
    """

    batches: int = 0
    replayed_batches: int = 0
    rows: int = 0
    written: int = 0
    duplicates: int = 0
    rejected: int = 0
    conflicts: int = 0
    #: ``wait="confirmed"``: the batches' rows as the wait left them (``Delivery``), and the
    #: batches whose wait ended at its timeout or with rows not confirmed
    confirmed: int = 0
    returned: int = 0
    nacked: int = 0
    failed: int = 0
    skipped: int = 0
    unsettled: int = 0
    timed_out_batches: int = 0
    undelivered_batches: int = 0

    def add(self, result: BatchResult) -> None:
        self.batches += 1
        self.replayed_batches += result.replayed
        self.rows += result.rows
        self.written += result.written
        self.duplicates += result.duplicates
        self.rejected += result.rejected
        self.conflicts += result.conflicts
        d = result.delivery
        if d is not None:
            self.confirmed += d.confirmed
            self.returned += d.returned
            self.nacked += d.nacked
            self.failed += d.failed
            self.skipped += d.skipped
            self.unsettled += d.open
            self.timed_out_batches += d.timed_out
            self.undelivered_batches += not d.ok


def write_outbox(
    df: DataFrame,
    options: OutboxOptions | None = None,
    /,
    *,
    batch_id: int | None = None,
    on_partition_committed: OnCommitted | None = None,
    **fields: Any,
) -> BatchResult:
    """Write a batch DataFrame into the outbox; the options are those of ``OutboxSink``.

    ``batch_id`` names the batch (``f"{sink}:{batch_id}"``). Without it the id is derived from
    the sink name and the DataFrame's content (row count and a sum of row hashes: one extra
    Spark job), so re-running a job over the same input is recognised as a replay and adds
    nothing. Pass ``batch_id`` to skip that job or to send the same rows again on purpose.
    """
    options = options_of(options, fields)
    sink = options.sink
    check_schema(df.schema, options)
    passes = (batch_id is None) + 1
    with persisted(df, passes=passes) as source:
        spark_batch_id = batch_id if batch_id is not None else content_batch_id(source, sink)
        batch = BatchRef(sink=sink, spark_batch_id=spark_batch_id)
        return run_batch(source, options=options, batch=batch, on_committed=on_partition_committed)


def run_batch(
    df: DataFrame,
    *,
    options: OutboxOptions,
    batch: BatchRef,
    on_committed: OnCommitted | None,
    stopped: Callable[[], bool] | None = None,
) -> BatchResult:
    """Write every partition from its executor (checking its rows on the way: the input is read
    once), then record the batch on the driver. In fail mode the batch is held meanwhile, so
    nothing of it is published unless every row of every partition was good. Then, with
    ``wait="confirmed"``, wait until the broker settled its rows (``writer.delivered``)."""
    result = _write_batch(df, options, batch, on_committed)
    return delivered(result, options=options, stopped=stopped)


def _write_batch(
    df: DataFrame, options: OutboxOptions, batch: BatchRef, on_committed: OnCommitted | None
) -> BatchResult:
    check_schema(df.schema, options)
    if batch_recorded(options=options, batch=batch):
        return replayed_result(batch)
    held = options.on_invalid == "fail"
    if held:
        hold_batch(options=options, batch=batch)
    plan = WritePlan(options=options, schema=df.schema, batch=batch, held=held)
    keyed = with_content_ids(df, options)
    ready = capped(laid_out(keyed, options), options.max_connections)
    try:
        results = write_job(ready, plan=plan, on_committed=on_committed)
    except BaseException:
        if held:
            _discard_after_failure(options, batch)
        raise
    return commit_batch(options=options, batch=batch, results=results, held=held)


def _discard_after_failure(options: OutboxOptions, batch: BatchRef) -> None:
    """The write job failed (a task error, a lost executor, a cancelled query): remove what its
    tasks committed into the held batch, best effort (the hold keeps it unpublished either way,
    and a re-run of the batch adds only what is missing)."""
    try:
        removed = discard_unrecorded(options=options, batch=batch)
    except Exception as error:  # the database may be what failed: the rows stay held
        log.warning(
            "outbox batch %s: write failed; its rows stay held until the batch is re-run (%s)",
            batch.key,
            error,
        )
    else:
        log.warning(
            "outbox batch %s: write failed; removed the %d row(s) its tasks had "
            "written (held, never published)",
            batch.key,
            removed,
        )


def with_content_ids(df: DataFrame, options: OutboxOptions) -> DataFrame:
    """Without a key column: each row's id comes from its content, never from where it sits.

    Adds the SHA-256 of the row (its JSON, every column) and the row's occurrence among the
    identical rows of the batch (``row_number`` over a window per digest). Identical rows are
    interchangeable, so whichever gets which number, a replay of the batch (the same multiset
    of rows, in any partitioning, order or parallelism) yields the same set of ids: it adds
    nothing and drops nothing. Costs one shuffle of the batch into as many partitions as it
    had (so the write keeps its parallelism)."""
    if options.message_id_column is not None:
        return df
    digest = F.sha2(F.to_json(F.struct(*[df[c] for c in df.columns])), 256)
    parts = max(1, df.rdd.getNumPartitions())
    keyed = df.withColumn(DIGEST, digest).repartition(parts, F.col(DIGEST))
    same = Window.partitionBy(DIGEST).orderBy(DIGEST)
    return keyed.withColumn(OCCURRENCE, F.row_number().over(same) - 1)


def laid_out(df: DataFrame, options: OutboxOptions) -> DataFrame:
    """With a ``sequence_column``: every row of a key in one partition, sorted by the sequence,
    so the partition's single transaction gives the key's rows ids in that order (and the
    publisher publishes them in id order). Without one, rows keep the input's layout: within a
    key, the order of rows within each input partition; no order across partitions."""
    if options.sequence_column is None or options.ordering_key_column is None:
        return df
    key, seq = options.ordering_key_column, options.sequence_column
    return df.repartition(F.col(key)).sortWithinPartitions(F.col(key), F.col(seq))


def capped(df: DataFrame, max_connections: int | None) -> DataFrame:
    """At most ``max_connections`` partitions (a coalesce: no shuffle), so at most that many
    tasks hold a database connection at once."""
    if max_connections is None or df.rdd.getNumPartitions() <= max_connections:
        return df
    return df.coalesce(max_connections)


def write_job(
    df: DataFrame, *, plan: WritePlan, on_committed: OnCommitted | None = None
) -> list[PartitionResult]:
    """One Spark job: each task writes its partition (Arrow batches in, as ``format("outbox")``
    gets them) and sends back its ``PartitionResult``."""
    task = partial(_arrow_task, plan=plan, on_committed=on_committed)
    rows = df.mapInArrow(task, "result binary").collect()
    return [pickle.loads(row["result"]) for row in rows]


@contextmanager
def persisted(df: DataFrame, *, passes: int) -> Iterator[DataFrame]:
    """``df``, persisted while in the block when it is read more than once and not cached."""
    if (
        passes < 2
        or not PERSIST_BETWEEN_PASSES
        or df.storageLevel.useMemory
        or df.storageLevel.useDisk
    ):
        yield df
        return
    df.persist()
    try:
        yield df
    finally:
        df.unpersist()


def content_batch_id(df: DataFrame, sink: str) -> int:
    """A batch id from the sink and the rows (count and a sum of xxhash64 of each row's JSON)."""
    row_hash = F.xxhash64(F.to_json(F.struct(*[df[c] for c in df.columns])))
    first = df.select(
        F.count(F.lit(1)).alias("n"), F.sum(row_hash.cast("decimal(38,0)")).alias("h")
    ).first()
    assert first is not None
    digest = hashlib.sha256(f"{sink}|{first['n']}|{first['h']}".encode()).hexdigest()
    return int(digest[:15], 16)


def _arrow_task(
    batches: Iterable[pa.RecordBatch], *, plan: WritePlan, on_committed: OnCommitted | None
) -> Iterator[pa.RecordBatch]:
    context = TaskContext.get()
    assert context is not None, "outbox writers run inside Spark tasks"
    result = write_partition(
        batches,
        plan=plan,
        partition=context.partitionId(),
        attempt=context.attemptNumber(),
        on_committed=on_committed,
    )
    yield pa.RecordBatch.from_pydict({"result": [pickle.dumps(result)]})


def _query_stopped(df: DataFrame, query_id: str | None) -> Callable[[], bool] | None:
    """Whether the streaming query running this micro-batch is being stopped. Spark's
    ``stop()`` sets the query's state, interrupts its stream execution thread and waits for the
    ``foreachBatch`` function to return; PySpark runs the function on a Python thread pinned to
    that JVM thread, so its interrupt flag says it. (The function's session is a clone whose
    ``streams`` knows no query.) Inert where the thread is not pinned (it is never interrupted
    then); None on Spark Connect, which has no JVM here."""
    if query_id is None:
        return None
    try:
        thread = df.sparkSession.sparkContext._jvm.java.lang.Thread.currentThread()  # type: ignore[union-attr]
    except Exception:  # no JVM gateway in this process
        return None
    return lambda: bool(thread.isInterrupted())


def _query_id(df: DataFrame) -> str | None:
    try:
        return df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:  # Spark Connect has no SparkContext; the id is then unknown
        return None
