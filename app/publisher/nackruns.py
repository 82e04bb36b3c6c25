"""Whose fault is a nack: the row's, or the destination's? Pure, no I/O.

A broker nacks a publish when a queue it routes to cannot take it: a queue at its length limit
with ``x-overflow=reject-publish``, or a quorum queue without a majority of its nodes (no
leader). The first may refuse some rows and take others; the second refuses everything, and so
does a full queue that nobody drains. Charging those nacks to the rows ends good rows ``nacked``
during a destination outage of a few minutes; never charging them makes a publisher republish
rows that one queue refuses for good, for ever.

The rule, per exchange, judged on **time, never on the size of one frame**: the nacks since the
last ack of a publish to that exchange form a **run**, and

- an ack to the same exchange, during the run or within ``outage_after`` seconds before it began
  (the destination takes other rows: these were refused, say by a queue full for them only),
  charges the run to its rows at once: each row's ``nacks`` goes up, ``nacked`` at
  ``max_attempts``;
- a run that has seen no ack of its exchange for ``outage_after`` seconds
  (``OUTBOX_DESTINATION_OUTAGE_AFTER``, 1 s) is judged then: **a destination outage** when it
  holds at least ``burst`` nacks (``OUTBOX_DESTINATION_NACK_BURST``, 20): its rows go back to
  ``pending`` without spending their nack budget, and the exchange pauses
  (:class:`~app.publisher.destinations.Destinations`, which also bounds how long an outage may
  keep rows waiting); fewer nacks than that (a few, and no other traffic) are charged.

A row waits for its verdict in the publisher's hands (``in_flight``, leased), at most
``outage_after`` seconds. A multiple nack of 50 rows among acks is 50 charged nacks, like 50
single ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Default of ``OUTBOX_DESTINATION_OUTAGE_AFTER``: an exchange that acked nothing this long
#: while nacking is out.
OUTAGE_AFTER = 1.0


@dataclass(slots=True)
class _Run:
    started: float
    rows: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Rows judged: ``charged`` spend their nack budget; ``outage`` names exchanges whose run
    saw no ack for ``outage_after`` seconds, each with its rows (back to pending, budget
    untouched)."""

    charged: list[int] = field(default_factory=list)
    outage: dict[str, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.charged or self.outage)


class NackRuns:
    """The open runs of nacks, per exchange; ``now`` is a monotonic clock passed in."""

    def __init__(self, *, burst: int, outage_after: float = OUTAGE_AFTER) -> None:
        self.burst = max(1, burst)
        self.outage_after = outage_after
        self._runs: dict[str, _Run] = {}
        self._last_ack: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def waiting(self) -> int:
        """Rows waiting for a verdict."""
        return sum(len(r.rows) for r in self._runs.values())

    def nacked(self, exchange: str, ids: list[int], now: float) -> list[int]:
        """Nacks of publishes to ``exchange``: returns the rows charged now (the exchange acked
        within ``outage_after``); the others wait in the exchange's run for :meth:`due`."""
        last = self._last_ack.get(exchange)
        if last is not None and now - last < self.outage_after:
            return list(ids)
        self._runs.setdefault(exchange, _Run(now)).rows.extend(ids)
        return []

    def acked(self, exchange: str, now: float) -> list[int]:
        """An ack of a publish to ``exchange``: its run (if any) was the rows' fault."""
        self._last_ack[exchange] = now
        run = self._runs.pop(exchange, None)
        return run.rows if run is not None else []

    def due(self, now: float) -> Verdict:
        """Runs with no ack for ``outage_after`` seconds: outages, or charged when short."""
        charged: list[int] = []
        outage: dict[str, list[int]] = {}
        for exchange in [x for x, run in self._runs.items() if self._judged(run, now)]:
            run = self._runs.pop(exchange)
            if len(run.rows) >= self.burst:
                outage[exchange] = run.rows
            else:
                charged += run.rows
        return Verdict(charged, outage)

    def _judged(self, run: _Run, now: float) -> bool:
        return now - run.started >= self.outage_after

    def next_due(self) -> float | None:
        """When the oldest open run is judged (None: no run open)."""
        starts = [run.started for run in self._runs.values()]
        return min(starts) + self.outage_after if starts else None

    def release_all(self) -> list[int]:
        """Stop: every row waiting for a verdict, no verdict given."""
        ids = [i for run in self._runs.values() for i in run.rows]
        self._runs.clear()
        return ids

    def drop(self, ids: set[int]) -> None:
        """Rows gone otherwise (their connection lost): no verdict for them."""
        for exchange in list(self._runs):
            run = self._runs[exchange]
            run.rows = [i for i in run.rows if i not in ids]
            if not run.rows:
                del self._runs[exchange]
