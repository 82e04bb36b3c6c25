"""One batch's write, in two halves: ``write_partition`` runs in each task (executor) and
commits that partition; ``commit_batch`` runs once on the driver after every task succeeded and
records the batch. Spark-free apart from the ``StructType`` carried in the plan; the
Spark-facing shells are ``sinks`` and ``datasource``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
from pyspark.sql.types import StructType

from spark_writer.db import CONFLICT, KeyConflicts, Store, open_store
from spark_writer.delivery import BatchResult
from spark_writer.envelope import ArrowMapper, BatchRef, Chunk, Problem, Rejected
from spark_writer.errors import (
    OutboxDataError,
    OutboxDeliveryError,
    OutboxReplicationError,
    ProblemCount,
)
from spark_writer.options import OutboxOptions
from spark_writer.watch import wait_for_batch


@dataclass(frozen=True, kw_only=True)
class WritePlan:
    """Everything a task needs to write its partition; pickled to the executors."""

    options: OutboxOptions
    schema: StructType
    batch: BatchRef
    #: sort each partition by (ordering key, sequence) in the task: ``format("outbox")``, whose
    #: input Spark lays out (the DataFrame writers sort with Spark before the write)
    sort_in_task: bool = False
    #: write the rows parked (never due) until ``commit_batch`` releases them: all or nothing
    #: when the rows are checked only in the tasks (``format("outbox")`` in fail mode)
    park: bool = False
    #: the driver held the batch before the tasks write (``OutboxSink`` and ``write_outbox``
    #: in fail mode): the inserts need not wake a publisher
    held: bool = False


@dataclass(frozen=True, kw_only=True)
class PartitionResult:
    """What one task did. ``skipped``: the batch was already recorded, nothing was written."""

    partition: int
    attempt: int
    rows: int = 0
    inserted: int = 0
    rejected: int = 0
    invalid: int = 0
    #: rows whose message id the outbox holds for another message (in ``rejected`` too in
    #: reject mode; in ``invalid`` in fail mode, where the partition wrote nothing)
    conflicts: int = 0
    skipped: bool = False
    problems: tuple[ProblemCount, ...] = ()


#: The driver logs one line per batch (what it wrote, replays, rejects) under this name.
log = logging.getLogger("spark_writer")

OnCommitted = Callable[[PartitionResult], None]


class _Invalid(Exception):
    """Raised into the write to roll a partition back at its first bad row (fail mode)."""


@dataclass
class _Tally:
    counts: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, problem: Problem, count: int = 1) -> None:
        entry = self.counts.setdefault(problem.summary, [0, problem.detail])
        entry[0] += count

    def result(self) -> tuple[ProblemCount, ...]:
        return tuple(ProblemCount(s, c, first) for s, (c, first) in self.counts.items())


class _Scan:
    """Maps one partition's Arrow batches, keeping count of rows, problems and rejects."""

    def __init__(self, plan: WritePlan, partition: int, batches: Iterable[pa.RecordBatch]) -> None:
        self.mapper = ArrowMapper(
            options=plan.options,
            schema=plan.schema,
            batch=plan.batch,
            partition=partition,
            parked=plan.park,
        )
        self.fail = plan.options.on_invalid == "fail"
        self.batches = iter(batches)
        self.seen = 0
        self.tally = _Tally()
        self.rejects: list[Rejected] = []

    def chunks(self) -> Iterator[Chunk]:
        for chunk in self._mapped():
            if chunk.rejected and self.fail:
                raise _Invalid
            self.rejects += chunk.rejected
            yield chunk

    def drain(self) -> None:
        """After the first bad row in fail mode: check the rest, to report every problem."""
        for _ in self._mapped():
            pass

    def _mapped(self) -> Iterator[Chunk]:
        for rb in self.batches:
            chunk = self.mapper.map(rb, self.seen)
            self.seen += rb.num_rows
            for rejected in chunk.rejected:
                self.tally.add(_described(rejected))
            yield chunk


def _described(rejected: Rejected) -> Problem:
    """The problem with the row named, for an error report (its detail when it says more)."""
    problem, where = rejected.problem, f"message id {rejected.message_id}"
    first = where if problem.detail == problem.summary else f"{problem.detail} ({where})"
    return Problem(problem.summary, first)


def write_partition(
    batches: Iterable[pa.RecordBatch],
    *,
    plan: WritePlan,
    partition: int,
    attempt: int,
    on_committed: OnCommitted | None = None,
) -> PartitionResult:
    """Write one partition in one transaction (executor side). Bad rows in fail mode: none."""
    batches = iter(batches)
    if plan.sort_in_task:
        batches = _sorted_by_key(batches, plan.options)
    first = next(batches, None)
    if first is None:  # an empty partition needs no connection
        return PartitionResult(partition=partition, attempt=attempt)
    with store_for(plan.options) as store:
        if store.batch_recorded(plan.batch):
            return PartitionResult(partition=partition, attempt=attempt, skipped=True)
        scan = _Scan(plan, partition, _prepend(first, batches))
        try:
            written = store.write(
                batch=plan.batch,
                layout=scan.mapper.layout,
                chunks=scan.chunks(),
                rejects=scan.rejects,
                first_attempt=attempt == 0,
                fail_on_conflict=scan.fail,
                quiet=plan.held,
            )
        except _Invalid:
            scan.drain()
            problems = scan.tally.result()
            invalid = sum(p.rows for p in problems)
            return PartitionResult(
                partition=partition,
                attempt=attempt,
                rows=scan.seen,
                invalid=invalid,
                problems=problems,
            )
        except KeyConflicts as error:
            for conflict in error.conflicts:
                scan.tally.add(conflict.problem)
            conflicts = len(error.conflicts)
            return PartitionResult(
                partition=partition,
                attempt=attempt,
                rows=scan.seen,
                invalid=conflicts,
                conflicts=conflicts,
                problems=scan.tally.result(),
            )
    for conflict in written.conflicts:
        scan.tally.add(conflict.problem)
    result = PartitionResult(
        partition=partition,
        attempt=attempt,
        rows=scan.seen,
        inserted=written.inserted,
        rejected=len(scan.rejects) + len(written.conflicts),
        conflicts=len(written.conflicts),
        problems=scan.tally.result(),
    )
    if on_committed is not None:
        on_committed(result)
    return result


def _sorted_by_key(
    batches: Iterator[pa.RecordBatch], options: OutboxOptions
) -> Iterator[pa.RecordBatch]:
    """The partition sorted by (ordering key, sequence) (held in memory: one partition)."""
    key, seq = options.ordering_key_column, options.sequence_column
    if key is None or seq is None:
        return batches
    table = pa.Table.from_batches(list(batches))
    if table.num_rows == 0:
        return iter(())
    ordered = table.sort_by([(key, "ascending"), (seq, "ascending")])
    return iter(ordered.to_batches())


def _prepend(first: pa.RecordBatch, rest: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield first
    yield from rest


def commit_batch(
    *,
    options: OutboxOptions,
    batch: BatchRef,
    results: Sequence[PartitionResult],
    parked: bool = False,
    held: bool = False,
) -> BatchResult:
    """Driver side, after every task succeeded: record the batch and sum up what it did.

    When a task found bad rows in fail mode (its partition wrote nothing), the batch is not
    recorded and ``OutboxDataError`` says what it found. ``parked`` (the tasks wrote their rows
    parked) or ``held`` (the batch was held before the tasks wrote): the rows are released with
    the batch's record (one transaction), or removed when the batch fails, so nothing of a
    failed batch is ever published.
    """
    rows = sum(r.rows for r in results)
    rejected = sum(r.rejected for r in results)
    written = sum(r.inserted for r in results)
    conflicts = sum(r.conflicts for r in results)
    if any(r.invalid for r in results):
        if parked or held:
            removed = discard_unrecorded(options=options, batch=batch)
            log.info(
                "outbox batch %s: removed the %d row(s) its tasks had written", batch.key, removed
            )
        error = OutboxDataError(
            batch_id=batch.key,
            problems=merge_problems(results),
            written=None if parked or held else written,
        )
        log.error("outbox batch %s not recorded: %s", batch.key, error)
        raise error
    with store_for(options) as store:
        fresh = store.record_batch(
            batch=batch, row_count=rows - rejected, rejected_count=rejected, release=parked
        )
        on_standbys(store, options, batch)
    log.info(
        "outbox batch %s: %d rows, %d written, %d already there (replays of the same message), "
        "%d rejected (%d of them message id conflicts)%s",
        batch.key,
        rows,
        written,
        rows - rejected - written,
        rejected,
        conflicts,
        "" if fresh else "; recorded before (a replay)",
    )
    if conflicts:
        first = next(p.first for p in merge_problems(results) if p.summary == CONFLICT)
        log.warning(
            "outbox batch %s: %d message id conflict(s) rejected, first: %s",
            batch.key,
            conflicts,
            first,
        )
    return BatchResult(
        batch_id=batch.key,
        spark_batch_id=batch.spark_batch_id,
        rows=rows,
        written=written,
        duplicates=rows - rejected - written,
        rejected=rejected,
        replayed=not fresh,
        conflicts=conflicts,
    )


def delivered(
    result: BatchResult, *, options: OutboxOptions, stopped: Callable[[], bool] | None = None
) -> BatchResult:
    """``wait="confirmed"``: wait on the driver until the recorded batch's rows are settled,
    log what became of them (one line per batch) and return the result with its ``Delivery``;
    ``OutboxDeliveryError`` (carrying that result) when a row is not confirmed. A replayed
    batch is waited on too: a re-run after a timeout waits for the rows the first run wrote.
    ``stopped``: the streaming query was stopped (the wait ends, and fails, at once)."""
    if options.wait != "confirmed":
        return result
    delivery = wait_for_batch(options, result.batch_id, stopped=stopped)
    result = replace(result, delivery=delivery)
    if delivery.ok:
        log.info(
            "outbox batch %s: delivered in %.1fs: %s",
            result.batch_id,
            delivery.waited,
            delivery.counts(),
        )
        return result
    error = OutboxDeliveryError(delivery)
    error.result = result
    log.error("outbox batch %s not delivered: %s", result.batch_id, error)
    raise error


def store_for(options: OutboxOptions) -> Store:
    """The outbox database the options name, opened here (in a task: on the executor)."""
    return open_store(options.url, password_file=options.password_file)


def hold_batch(*, options: OutboxOptions, batch: BatchRef) -> None:
    """Hold the batch before its tasks write: no publisher claims its rows until it is
    recorded (``commit_batch``), and ``discard_unrecorded`` removes them if it fails."""
    with store_for(options) as store:
        store.hold(batch)


def discard_unrecorded(*, options: OutboxOptions, batch: BatchRef) -> int:
    """Remove the never-published rows of a batch that will not be recorded (parked, or of a
    held batch); how many there were."""
    with store_for(options) as store:
        return store.discard_unrecorded(batch)


def replayed_result(batch: BatchRef) -> BatchResult:
    """The result of a batch that was recorded before and so was not written again."""
    log.info("outbox batch %s recorded before: a replay, nothing written", batch.key)
    return BatchResult(
        batch_id=batch.key,
        spark_batch_id=batch.spark_batch_id,
        rows=0,
        written=0,
        duplicates=0,
        rejected=0,
        replayed=True,
    )


_UNREADABLE_TOLD: list[bool] = []


def on_standbys(store: Store, options: OutboxOptions, batch: BatchRef) -> None:
    """Return once every streaming standby has the recorded batch on disk, or raise
    ``OutboxReplicationError`` after ``standby_wait`` seconds. With asynchronous replication a
    failover loses what the standby had not received: a batch Spark had marked done would be
    gone for good. A synchronous standby has it at the commit already (no wait)."""
    if options.standby_wait <= 0:
        return
    found = store.wait_for_standbys(options.standby_wait)
    if found.behind is None:
        if not _UNREADABLE_TOLD:
            _UNREADABLE_TOLD.append(True)
            log.warning(
                "outbox batch %s: the database streams to a standby whose position this role "
                "may not read (grant it pg_read_all_stats): batches are not waited for on the "
                "standby, and a failover may undo the last of them",
                batch.key,
            )
        return
    if found.behind > 0:
        error = OutboxReplicationError(batch_id=batch.key, behind=found.behind, waited=found.waited)
        log.error("%s", error)
        raise error
    if found.waited >= 1.0:
        log.info("outbox batch %s: on every standby after %.1fs", batch.key, found.waited)


def batch_recorded(*, options: OutboxOptions, batch: BatchRef) -> bool:
    """Whether the batch is recorded (a replay); a replay waits for the standbys too: the first
    run may have failed waiting for them."""
    with store_for(options) as store:
        recorded = store.batch_recorded(batch)
        if recorded:
            on_standbys(store, options, batch)
        return recorded


def merge_problems(results: Sequence[PartitionResult]) -> tuple[ProblemCount, ...]:
    """Problems of all partitions, counted together, in the order first seen."""
    tally = _Tally()
    for result in results:
        for p in result.problems:
            tally.add(Problem(p.summary, p.first), p.rows)
    return tally.result()
