"""Errors of the Spark writer, split by blame.

``OutboxWriterError``
├── ``OutboxConfigError``: the writer's options are wrong (the caller's code).
├── ``OutboxSchemaError``: the DataFrame lacks a column or a column has the wrong type.
└── ``OutboxDataError``: rows hold values the outbox cannot take; nothing of the batch was written.

Database failures are not wrapped: psycopg and sqlite3 errors propagate as they are, and the
batch stays unrecorded (and invisible to publishers) until a run of it succeeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class ProblemCount(NamedTuple):
    """How many rows share one problem, with the first row's own description."""

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
    """Some rows cannot go to the outbox; the whole batch was left unwritten."""

    def __init__(self, *, batch_id: str, problems: Sequence[ProblemCount]) -> None:
        self.batch_id = batch_id
        self.problems = tuple(problems)
        invalid = sum(p.rows for p in problems)
        parts = [f"{p.summary}: {p.rows} row(s), first: {p.first}" for p in problems]
        super().__init__(
            f"batch {batch_id}: {invalid} invalid row(s), nothing written ({'; '.join(parts)}). "
            "Fix the rows or pass on_invalid='reject' to send them to outbox_rejects."
        )
