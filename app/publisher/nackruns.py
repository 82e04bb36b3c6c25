"""Whose fault is a nack: the row's, or the destination's? Pure, no I/O.

A broker nacks a publish when a queue it routes to cannot take it: a queue at its length limit
with ``x-overflow=reject-publish``, or a quorum queue without a majority of its nodes (no
leader). The first may refuse some rows and take others; the second refuses everything, and so
does a full queue that nobody drains. Charging those nacks to the rows ends good rows ``nacked``
during a destination outage of a few minutes.

The rule, per exchange: the nacks since the last ack of a publish to that exchange form a
**run**. A run is judged

- **the rows' fault** when an ack to the same exchange arrives (the destination takes other
  rows: these were refused, say by a queue that is full for them only), or when
  :data:`VERDICT_AFTER` seconds pass with fewer than ``burst`` nacks in it (a few nacks and no
  other traffic): each row's ``nacks`` goes up, ``nacked`` at ``max_attempts``;
- **a destination outage** when it reaches ``burst`` nacks (``OUTBOX_DESTINATION_NACK_BURST``,
  20) with no ack in between: its rows go back to ``pending`` without spending their nack
  budget, and the exchange pauses (:class:`~app.publisher.destinations.Destinations`).

A row waits for its verdict in the publisher's hands (``in_flight``, leased), at most
:data:`VERDICT_AFTER` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: A run with fewer than ``burst`` nacks and no ack after this long is charged to its rows.
VERDICT_AFTER = 1.0


@dataclass(slots=True)
class _Run:
    started: float
    rows: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Rows judged: ``charged`` spend their nack budget; ``outage`` names exchanges whose run
    reached the burst, each with its rows (back to pending, budget untouched)."""

    charged: list[int] = field(default_factory=list)
    outage: dict[str, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.charged or self.outage)


class NackRuns:
    """The open runs of nacks, per exchange; ``now`` is a monotonic clock passed in."""

    def __init__(self, *, burst: int, verdict_after: float = VERDICT_AFTER) -> None:
        self.burst = max(1, burst)
        self.verdict_after = verdict_after
        self._runs: dict[str, _Run] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def waiting(self) -> int:
        """Rows waiting for a verdict."""
        return sum(len(r.rows) for r in self._runs.values())

    def nacked(self, exchange: str, ids: list[int], now: float) -> Verdict:
        run = self._runs.setdefault(exchange, _Run(now))
        run.rows.extend(ids)
        if len(run.rows) < self.burst:
            return Verdict()
        del self._runs[exchange]
        return Verdict(outage={exchange: run.rows})

    def acked(self, exchange: str) -> list[int]:
        """An ack of a publish to ``exchange``: its run (if any) was the rows' fault."""
        run = self._runs.pop(exchange, None)
        return run.rows if run is not None else []

    def due(self, now: float) -> list[int]:
        """Runs older than :attr:`verdict_after`, still under the burst: charged."""
        late = [x for x, run in self._runs.items() if now - run.started >= self.verdict_after]
        return [i for x in late for i in self._runs.pop(x).rows]

    def next_due(self) -> float | None:
        """When the oldest open run is judged (None: no run open)."""
        starts = [run.started for run in self._runs.values()]
        return min(starts) + self.verdict_after if starts else None

    def drop(self, ids: set[int]) -> None:
        """Rows gone otherwise (their connection lost): no verdict for them."""
        for exchange in list(self._runs):
            run = self._runs[exchange]
            run.rows = [i for i in run.rows if i not in ids]
            if not run.rows:
                del self._runs[exchange]
