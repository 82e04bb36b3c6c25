"""One batch's write, in two halves: ``write_partition`` runs in each task (executor), and
``commit_batch`` / ``abort_batch`` run once on the driver after the tasks. Spark-free apart from
the ``StructType`` carried in the plan; the Spark-facing shells are ``sinks`` and ``datasource``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.types import StructType

from spark_writer.db import open_store
from spark_writer.envelope import BatchRef, Envelope, Problem, Rejected, RowMapper
from spark_writer.errors import OutboxDataError, ProblemCount
from spark_writer.options import OutboxOptions


@dataclass(frozen=True, kw_only=True)
class WritePlan:
    """Everything a task needs to write its partition; pickled to the executors."""

    options: OutboxOptions
    schema: StructType
    batch: BatchRef


@dataclass(frozen=True, kw_only=True)
class PartitionResult:
    """What one task did. ``skipped``: the batch was already recorded, nothing was written."""

    partition: int
    attempt: int
    rows: int = 0
    inserted: int = 0
    rejected: int = 0
    invalid: int = 0
    skipped: bool = False
    problems: tuple[ProblemCount, ...] = ()


@dataclass(frozen=True, kw_only=True)
class BatchResult:
    """The outcome of one batch.

    ``rows``: rows in the batch; ``written``: rows new to the outbox; ``duplicates``: valid rows
    whose ``message_id`` was there already (a retried task, a replay, a repeated key);
    ``rejected``: rows put in ``outbox_rejects``; ``replayed``: the batch had been recorded before.
    """

    batch_id: str
    spark_batch_id: int
    rows: int
    written: int
    duplicates: int
    rejected: int
    replayed: bool


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
    """Maps one partition's rows, keeping count of rows, problems and rejects."""

    def __init__(self, plan: WritePlan, partition: int, rows: Iterable[tuple[Any, ...]]) -> None:
        self.mapper = RowMapper(
            options=plan.options, schema=plan.schema, batch=plan.batch, partition=partition
        )
        self.fail = plan.options.on_invalid == "fail"
        self.rows = enumerate(rows)
        self.seen = 0
        self.tally = _Tally()
        self.rejects: list[Rejected] = []

    def envelopes(self) -> Iterator[Envelope]:
        for position, row in self.rows:
            self.seen += 1
            out = self.mapper.map(row, position)
            if isinstance(out, Envelope):
                yield out
                continue
            self.tally.add(out.problem)
            if self.fail:
                raise _Invalid
            self.rejects.append(out)

    def drain(self) -> None:
        """After the first bad row in fail mode: check the rest, to report every problem."""
        for position, row in self.rows:
            self.seen += 1
            out = self.mapper.map(row, position)
            if isinstance(out, Rejected):
                self.tally.add(out.problem)


def write_partition(
    rows: Iterable[tuple[Any, ...]],
    *,
    plan: WritePlan,
    partition: int,
    attempt: int,
    on_committed: OnCommitted | None = None,
) -> PartitionResult:
    """Write one partition in one transaction (executor side). Bad rows in fail mode: none."""
    with open_store(plan.options.url) as store:
        if store.batch_recorded(plan.batch):
            return PartitionResult(partition=partition, attempt=attempt, skipped=True)
        scan = _Scan(plan, partition, rows)
        try:
            inserted = store.write(
                batch=plan.batch, envelopes=scan.envelopes(), rejects=scan.rejects
            )
        except _Invalid:
            scan.drain()
            problems = scan.tally.result()
            return PartitionResult(
                partition=partition,
                attempt=attempt,
                rows=scan.seen,
                invalid=sum(p.rows for p in problems),
                problems=problems,
            )
    result = PartitionResult(
        partition=partition,
        attempt=attempt,
        rows=scan.seen,
        inserted=inserted,
        rejected=len(scan.rejects),
        problems=scan.tally.result(),
    )
    if on_committed is not None:
        on_committed(result)
    return result


def commit_batch(
    *, options: OutboxOptions, batch: BatchRef, results: Sequence[PartitionResult]
) -> BatchResult:
    """Driver side, after every task succeeded: make the batch visible and record it, or, when
    a task found bad rows in fail mode, remove what the others wrote and raise."""
    invalid = sum(r.invalid for r in results)
    with open_store(options.url) as store:
        if invalid:
            store.abort_batch(batch=batch)
            raise OutboxDataError(batch_id=batch.key, problems=merge_problems(results))
        rows = sum(r.rows for r in results)
        rejected = sum(r.rejected for r in results)
        fresh = store.commit_batch(batch=batch, row_count=rows - rejected, rejected_count=rejected)
    written = sum(r.inserted for r in results)
    return BatchResult(
        batch_id=batch.key,
        spark_batch_id=batch.spark_batch_id,
        rows=rows,
        written=written,
        duplicates=rows - rejected - written,
        rejected=rejected,
        replayed=not fresh,
    )


def abort_batch(*, options: OutboxOptions, batch: BatchRef) -> None:
    """Driver side, after a failed job: remove the parked rows of an unrecorded batch."""
    with open_store(options.url) as store:
        store.abort_batch(batch=batch)


def replayed_result(batch: BatchRef) -> BatchResult:
    """The result of a batch that was recorded before and so was not written again."""
    return BatchResult(
        batch_id=batch.key,
        spark_batch_id=batch.spark_batch_id,
        rows=0,
        written=0,
        duplicates=0,
        rejected=0,
        replayed=True,
    )


def batch_recorded(*, options: OutboxOptions, batch: BatchRef) -> bool:
    with open_store(options.url) as store:
        return store.batch_recorded(batch)


def merge_problems(results: Sequence[PartitionResult]) -> tuple[ProblemCount, ...]:
    """Problems of all partitions, counted together, in the order first seen."""
    tally = _Tally()
    for result in results:
        for p in result.problems:
            tally.add(Problem(p.summary, p.first), p.rows)
    return tally.result()
