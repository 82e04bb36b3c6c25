"""The rows one publisher holds, and where each one is. Plain state, no I/O, no asyncio.

A row is *held* from the claim that returned it until the write-back that settles it in the
database: in the send ``queue`` (claimed, not yet published), ``parked`` behind an exchange check,
in the quarantine (:mod:`app.publisher.settlement`), or published and awaiting the broker (where
and when it went out is the confirm ledger's record, :mod:`app.confirms`). A row settled by a
write-back is forgotten before a later claim of it is accepted: on one database thread because
results reach the loop in order; with claims on their own lane because the claimer waits for the
write-back that settles a row it claimed again (:mod:`app.publisher.dbthread`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat

from app.outbox.records import ClaimedRow


class Holdings:
    """Held rows by id, the send queue and rows parked per exchange."""

    def __init__(self) -> None:
        self.held: dict[int, ClaimedRow] = {}
        self.queue: deque[ClaimedRow] = deque()
        self.parked: dict[str, list[ClaimedRow]] = {}
        self.since: dict[int, float] = {}  # row -> monotonic time of the claim that took it

    def __len__(self) -> int:
        return len(self.held)

    def accept(self, rows: Sequence[ClaimedRow], *, at: float, send: bool = True) -> int:
        """Rows of a finished claim: held, queued to be sent in claim order. A row this
        publisher holds already (the database lost its claim: a failover to a standby without
        it, or a lease swept while the process was paused) takes the new lease but is not
        queued again: its publish is on the wire, or answered with the answer not written yet,
        and that answer settles it under the new lease. Queued again, it went out twice.
        Returns how many rows were held already."""
        held = self.held
        fresh = [row for row in rows if row.id not in held]
        for row in rows:
            held[row.id] = row
        self.since.update(zip((r.id for r in fresh), repeat(at)))
        if send:  # else held to be settled without a publish (its message went out before)
            self.queue.extend(fresh)
        return len(rows) - len(fresh)

    def take(self, limit: int) -> list[ClaimedRow]:
        queue = self.queue
        return [queue.popleft() for _ in range(min(limit, len(queue)))]

    def put_back(self, rows: Sequence[ClaimedRow]) -> None:
        """Rows taken but not sent (no channel now): first in line again, in order."""
        self.queue.extendleft(reversed(rows))

    def park(self, row: ClaimedRow) -> None:
        self.parked.setdefault(row.exchange, []).append(row)

    def unpark(self, exchange: str) -> list[ClaimedRow]:
        """The rows waiting for ``exchange``, taken out of the parking."""
        return self.parked.pop(exchange, [])

    def rows(self, ids: Iterable[int]) -> list[ClaimedRow]:
        held = self.held
        return [row for i in ids if (row := held.get(i)) is not None]

    def bump_attempts(self, ids: Iterable[int]) -> None:
        """Rows published again while held (quarantine): their next publish is a new attempt."""
        held = self.held
        for row_id in ids:
            row = held.get(row_id)
            if row is not None:
                held[row_id] = row._replace(attempts=row.attempts + 1)

    def forget(self, ids: Iterable[int]) -> None:
        """Rows the database no longer has this publisher hold."""
        held, since = self.held, self.since
        for row_id in ids:
            held.pop(row_id, None)
            since.pop(row_id, None)

    def unsent(self) -> list[ClaimedRow]:
        """Every queued and parked row, taken out (to be released on stop)."""
        rows = list(self.queue)
        self.queue.clear()
        for parked in self.parked.values():
            rows.extend(parked)
        self.parked.clear()
        return rows

    def oldest_since(self) -> float | None:
        """Monotonic claim time of the oldest held row, None when none is held."""
        return min(self.since.values(), default=None)
