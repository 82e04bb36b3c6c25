"""What became of a batch's rows at the broker, and when a wait for it is over. Pure: no Spark,
no database, no clock (``watch`` polls the outbox and feeds these).

A row is *settled* when it left ``pending`` and ``in_flight`` for good: ``confirmed`` (the
broker acked it, no return), a terminal failure (``returned``, ``nacked``, ``failed``), or
``skipped``: an operator's audited decision that a failed row will not be delivered, which
settles it without failing the wait (else a re-run of the batch could never pass). A row back in
``pending`` after a nack, a lost confirm or a ``312 NO_ROUTE`` within the return grace is
*retrying*: not settled, the publisher sends it again. A keyed row behind a row of its key that
ended in a failure is *blocked*: it moves only when an operator republishes or skips that row,
so a wait counts it as an outcome rather than waiting for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

Wait = Literal["written", "confirmed"]
WAITS: tuple[Wait, ...] = ("written", "confirmed")
#: Seconds ``wait="confirmed"`` waits for a batch's rows by default.
DEFAULT_WAIT_TIMEOUT = 300.0

#: Terminal states that are not a delivery, in the order a report names them (``skipped``
#: among them: not delivered, but an operator's decision, not a failure of the wait).
FAILURES = ("returned", "nacked", "failed", "skipped")
OPEN = ("pending", "in_flight")


class Reason(NamedTuple):
    """How many rows of one failure status share one reason, with one of their message ids."""

    status: str
    reason: str
    rows: int
    first: str


class Poll(NamedTuple):
    """One look at a batch's rows: rows per status, and of the ``pending`` ones how many were
    claimed before (``retrying``); ``blocked``: open rows that wait behind a failed row of their
    ordering key (None: not looked at)."""

    counts: Mapping[str, int]
    retrying: int = 0
    blocked: int | None = None


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """What the broker made of one batch's rows when the wait ended.

    ``rows``: the batch's rows in the outbox (rows a writer skipped as replays of another
    batch's message are that batch's; rejected rows are not in the outbox). ``pending`` holds
    ``retrying``; ``blocked`` rows are among ``pending``. ``timed_out``: the wait ended at its
    timeout with rows still open; ``stopped``: it ended because its streaming query was
    stopped meanwhile.
    """

    batch_id: str
    rows: int
    confirmed: int
    returned: int = 0
    nacked: int = 0
    failed: int = 0
    skipped: int = 0
    pending: int = 0
    in_flight: int = 0
    retrying: int = 0
    blocked: int = 0
    reasons: tuple[Reason, ...] = ()
    waited: float = 0.0
    timed_out: bool = False
    stopped: bool = False

    @property
    def undelivered(self) -> int:
        """Rows that ended in a failure (returned, nacked, failed)."""
        return self.returned + self.nacked + self.failed

    @property
    def open(self) -> int:
        return self.pending + self.in_flight

    @property
    def ok(self) -> bool:
        """Every row of the batch confirmed (or skipped by an operator)."""
        settled_well = self.confirmed + self.skipped == self.rows
        return settled_well and not self.timed_out and not self.stopped

    def counts(self) -> str:
        """``"1000 row(s): 960 confirmed, 40 returned"`` (zero figures left out)."""
        parts = [f"{self.confirmed} confirmed"]
        parts += [f"{getattr(self, s)} {s}" for s in FAILURES if getattr(self, s)]
        if self.pending:
            why = [
                f"{n} {what}"
                for n, what in (
                    (self.retrying, "retrying"),
                    (self.blocked, "blocked behind a failed row of their key"),
                )
                if n
            ]
            parts.append(f"{self.pending} pending" + (f" ({', '.join(why)})" if why else ""))
        if self.in_flight:
            parts.append(f"{self.in_flight} in flight")
        return f"{self.rows} row(s): " + ", ".join(parts)

    def first_reasons(self) -> str:
        return "; ".join(
            f"{r.status} {r.reason}: {r.rows} row(s), first {r.first}" for r in self.reasons
        )


def delivery_of(
    batch_id: str,
    poll: Poll,
    *,
    reasons: Sequence[Reason] = (),
    waited: float = 0.0,
    timed_out: bool = False,
    stopped: bool = False,
) -> Delivery:
    """The summary of one poll of the batch's rows."""
    c = poll.counts
    return Delivery(
        batch_id=batch_id,
        rows=sum(c.values()),
        confirmed=c.get("confirmed", 0),
        returned=c.get("returned", 0),
        nacked=c.get("nacked", 0),
        failed=c.get("failed", 0),
        skipped=c.get("skipped", 0),
        pending=c.get("pending", 0),
        in_flight=c.get("in_flight", 0),
        retrying=poll.retrying,
        blocked=poll.blocked or 0,
        reasons=tuple(reasons),
        waited=waited,
        timed_out=timed_out,
        stopped=stopped,
    )


def settled(poll: Poll) -> bool:
    """The wait is over: no row is open, or every open row is blocked behind a failed row."""
    open_rows = sum(poll.counts.get(s, 0) for s in OPEN)
    return open_rows == 0 or poll.blocked == open_rows


def look_for_blocked(poll: Poll, previous: Poll | None) -> bool:
    """Worth the query for blocked rows: rows are open and either some ended in a failure or
    nothing moved since the last poll (a key may be parked by an earlier batch's row)."""
    open_rows = sum(poll.counts.get(s, 0) for s in OPEN)
    if not open_rows:
        return False
    if any(poll.counts.get(s, 0) for s in FAILURES):
        return True
    return previous is not None and dict(previous.counts) == dict(poll.counts)


def next_interval(interval: float, *, query_seconds: float) -> float:
    """The pause before the next poll: growing by half from 50 ms to ``LONGEST_PAUSE``, and never
    under ten times what the last poll's queries took (the wait costs the database at most a
    tenth of one connection's time, whatever the batch's size)."""
    return max(min(interval * 1.5, LONGEST_PAUSE), 10 * query_seconds)


#: The first pause between polls.
FIRST_INTERVAL = 0.05
#: The longest pause between polls of a small batch: what the wait adds, at most, to a batch
#: settled just after a poll.
LONGEST_PAUSE = 0.5


def checked_wait(wait: object) -> Wait:
    """``wait`` as given by a caller (untrusted): ``"written"`` or ``"confirmed"``."""
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {list(WAITS)}, not {wait!r}")
    return wait


def checked_timeout(timeout: object) -> float:
    """``wait_timeout`` as given (untrusted): a finite number of seconds above zero."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError(f"wait_timeout must be a number of seconds, not {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"wait_timeout must be a finite number of seconds above 0, not {timeout!r}"
        )
    return float(timeout)


@dataclass(frozen=True, kw_only=True)
class BatchResult:
    """The outcome of one batch.

    ``rows``: rows in the batch; ``written``: rows new to the outbox; ``duplicates``: fit rows
    whose ``message_id`` was there already for the same message (a retried task, a re-run, the
    same row twice): true replays, nothing lost; ``rejected``: rows put in ``outbox_rejects``,
    ``conflicts`` among them (reject mode): rows whose ``message_id`` the outbox holds for
    another message (another sink, exchange, routing key, stream, body, headers, ...);
    ``replayed``: the batch had been recorded before. ``rows == written + duplicates +
    rejected``.
    """

    batch_id: str
    spark_batch_id: int
    rows: int
    written: int
    duplicates: int
    rejected: int
    replayed: bool
    conflicts: int = 0
    delivery: Delivery | None = None
