"""Errors of the Spark writer, split by blame.

``OutboxWriterError``
├── ``OutboxConfigError``: the writer's options are wrong (the caller's code).
├── ``OutboxSchemaError``: the DataFrame lacks a column or a column has the wrong type.
├── ``OutboxDataError``: rows hold values the outbox cannot take; the batch is not recorded.
└── ``OutboxDeliveryError``: (``wait="confirmed"``) rows of a recorded batch ended returned,
    nacked or failed at the broker, or were not settled by the timeout (the broker, the
    publisher or the topology: not the caller's code). The batch stays recorded; a re-run adds
    no row and waits again.

A row whose message id the outbox holds for another message (a conflict) is a bad row too.
Database failures are not wrapped: psycopg and sqlite3 errors propagate as they are. A failed
batch is not recorded in ``outbox_batches``. In fail mode nothing of it is published (its rows
were held or parked, and are removed); a re-run of the batch adds only what is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from spark_writer.delivery import BatchResult, Delivery


class ProblemCount(NamedTuple):
    """How many rows share one problem, with an example row."""

    summary: str
    rows: int
    first: str


class OutboxWriterError(Exception):
    """Base of every error the Spark writer raises itself."""


class OutboxConfigError(OutboxWriterError, ValueError):
    """The options given to the writer are wrong or contradict each other."""


class OutboxSchemaError(OutboxWriterError, ValueError):
    """The DataFrame's schema does not fit the options: a missing column or a wrong type."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("DataFrame does not fit the outbox options: " + "; ".join(problems))


class OutboxDataError(OutboxWriterError, ValueError):
    """Some rows cannot go to the outbox; the batch is not recorded.

    The executors found them; the partitions holding them wrote nothing. ``written`` is None
    when nothing of the batch stays in the outbox (fail mode: the batch was held, or its rows
    parked, and they were removed); otherwise the other partitions wrote ``written`` rows.
    """

    def __init__(
        self, *, batch_id: str, problems: Sequence[ProblemCount], written: int | None = None
    ) -> None:
        self.batch_id = batch_id
        self.problems = tuple(problems)
        self.written = written
        invalid = sum(p.rows for p in problems)
        parts = [f"{p.summary}: {p.rows} row(s), first: {p.first}" for p in problems]
        done = (
            "nothing written"
            if written is None
            else f"batch not recorded; partitions without bad rows wrote {written} row(s)"
        )
        super().__init__(
            f"batch {batch_id}: {invalid} invalid row(s), {done} ({'; '.join(parts)}). "
            "Fix the rows or pass on_invalid='reject' to send them to outbox_rejects."
        )


class OutboxReplicationError(OutboxWriterError):
    """The batch is recorded on the primary, but a streaming standby did not have it on disk
    within ``standby_wait`` seconds: a failover to that standby would undo the batch, and Spark
    (whose checkpoint would say it is done) would not write it again. The batch fails, so Spark
    runs it again: the re-run writes nothing new and waits again."""

    def __init__(self, *, batch_id: str, behind: int, waited: float) -> None:
        self.batch_id = batch_id
        self.behind = behind
        self.waited = waited
        super().__init__(
            f"batch {batch_id}: recorded on the primary, but a standby is still {behind} bytes "
            f"of WAL short of it after {waited:.1f}s (standby_wait). A failover now would undo "
            "it without Spark knowing; failing the batch so Spark runs it again (a re-run adds "
            "no row). Check the standby's replication (pg_stat_replication)."
        )


class OutboxDeliveryError(OutboxWriterError):
    """``wait="confirmed"``: rows of the batch were not all confirmed (an operator's skip
    aside). ``delivery`` says what
    became of each (per status, the first reasons); ``timed_out``: rows were still open when
    the wait ended. The batch is recorded: re-running it writes nothing and waits again."""

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery
        #: the writer's result with this delivery (set by the writer that waited)
        self.result: BatchResult | None = None
        self.batch_id = delivery.batch_id
        self.timed_out = delivery.timed_out
        d = delivery
        if d.stopped:
            head = f"its streaming query was stopped after waiting {d.waited:.1f}s: {d.counts()}"
        elif d.timed_out:
            head = f"not settled after waiting {d.waited:.1f}s: {d.counts()}"
            if d.open and not d.retrying and d.pending == d.open and d.confirmed == 0:
                head += " (no row was claimed: is a publisher running on this outbox?)"
        else:
            missing = d.rows - d.confirmed - d.skipped
            head = f"{missing} of {d.rows} row(s) not delivered: {d.counts()}"
        reasons = f" ({d.first_reasons()})" if d.reasons else ""
        advice = "The batch is recorded: re-running the job adds no row and waits again" + (
            f"; republish with `outbox republish --batch {d.batch_id}`" if d.undelivered else ""
        )
        super().__init__(f"batch {d.batch_id}: {head}{reasons}. {advice}")
