"""Destination outages: an exchange whose queues nack everything is paused, its rows kept
pending without spending their nack budget, and resumed once a probe publish is confirmed.

The verdict on nacks is pure (:mod:`app.publisher.nackruns`); this part applies it: charged
nacks go to the write-back as nacks, an outage pauses the exchange
(:meth:`~app.publisher.destinations.Destinations.outage`), postpones its rows, logs once, and
counts it; an ack of a publish to a paused exchange ends the outage (logged with its
duration). An outage that has kept rows waiting ``destination_outage_max_wait`` (counted from
its start, across short recoveries) is over for its rows: its nacks are charged from then on.
Runs its own timer for the verdicts that wait (``destination_outage_after``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence

from app.confirms import Confirmed, Event, Nacked, Returned
from app.publisher.nackruns import OUTAGE_AFTER, NackRuns
from app.publisher.outcomes import Outcomes
from app.publisher.settlement import outage_reason
from app.publisher.wiring import Shared

log = logging.getLogger("app.publisher")

OUTAGE_WHY = "the broker nacked {n} publishes and acked none for {s:g}s"
#: a nacked probe drops the connection at most this often per exchange (seconds)
REFRESH_EVERY = 10.0


class Outages:
    def __init__(
        self,
        shared: Shared,
        *,
        outcomes: Callable[[], Outcomes],
        unpark: Callable[[str], None],
        burst: int,
        outage_after: float = OUTAGE_AFTER,
    ) -> None:
        """``outcomes``: the write-back's current buffer; ``unpark``: rows parked behind a
        probe to this exchange may go (the sender)."""
        self.p = shared
        self.outcomes = outcomes
        self.unpark = unpark
        self.runs = NackRuns(burst=burst, outage_after=outage_after)
        self._timer: asyncio.TimerHandle | None = None
        #: exchange -> when a nacked probe to it last dropped the connection
        self._refreshed: dict[str, float] = {}

    def answered(self, events: Sequence[Event]) -> list[Event]:
        """Take the nacks out of ``events`` (judged here) and watch the acks for the ends of
        outages and runs; returns the events left for plain settlement."""
        rest: list[Event] = []
        for event in events:
            if isinstance(event, Nacked):
                self._nacked(event.row_ids)
            else:
                if isinstance(event, Confirmed):
                    self._acked(event.row_ids)
                elif isinstance(event, Returned):
                    self.lost([event.row_id])  # a returned probe says nothing: pick another
                rest.append(event)
        return rest

    def lost(self, ids: Collection[int]) -> None:
        """Rows that left without an ack or a nack (lost with their channel or connection,
        returned, put back, settled by the write-back however they ended): a probe among them
        is picked again, or its exchange's parked rows would wait for an answer that never
        comes."""
        if not self.p.destinations.outages():
            return
        for exchange in self.p.destinations.probe_lost(ids):
            self.unpark(exchange)

    def release_all(self) -> list[int]:
        """Stop: rows waiting for a verdict go back as they were (no nack charged)."""
        if self._timer is not None:
            self._timer.cancel()
        return self.runs.release_all()

    # ------------------------------------------------------------ nacks and acks

    def _exchange(self, row_id: int) -> str | None:
        row = self.p.holdings.held.get(row_id)
        return row.exchange if row is not None else None

    def _nacked(self, ids: Sequence[int]) -> None:
        p, now = self.p, self.p.clock()
        p.quarantine.settled(ids)
        charged: list[int] = []
        for exchange, rows in _by_exchange(ids, self._exchange).items():
            if exchange is None or p.destinations.charging(exchange):
                charged += rows  # not held any more (the write-back's guard decides), or overdue
            elif p.destinations.in_outage(exchange):
                if self._overdue(exchange, now):
                    charged += rows
                    continue
                probe = p.destinations.probe(exchange)
                self._outage(exchange, rows, now)
                last = self._refreshed.get(exchange)
                due = last is None or now - last >= REFRESH_EVERY
                if probe is not None and probe in rows and due:
                    # A failed probe drops the connection: the next probe goes on a fresh one,
                    # to another node (a channel opened during a leader election kept nacking a
                    # quorum queue whose new leader took publishes on any other connection; in
                    # scenario 17g a fresh connection to a surviving node nacked for a minute).
                    # Not at every probe: a reconnect costs the other exchanges' unconfirmed rows
                    self._refreshed[exchange] = now
                    p.session.reconnect(f"the probe to exchange {exchange!r} was nacked")
            else:
                charged += self.runs.nacked(exchange, rows, now)
        self._charge(charged)
        self._arm()

    def _acked(self, ids: Sequence[int]) -> None:
        p, now = self.p, self.p.clock()
        charged: list[int] = []
        for exchange in {self._exchange(i) for i in ids}:
            if exchange is None:
                continue
            charged += self.runs.acked(exchange, now)
            lasted = p.destinations.recovered(exchange, now)
            if lasted is not None:
                self._refreshed.pop(exchange, None)
                log.warning(
                    "exchange %r takes publishes again: its outage lasted %.1fs", exchange, lasted
                )
                self.unpark(exchange)
        self._charge(charged)

    def _charge(self, ids: list[int]) -> None:
        """Nacks that are the rows' fault: each spends the row's nack budget."""
        if ids:
            self.outcomes().nacked.extend(ids)
            self.p.wake.set()

    def _overdue(self, exchange: str, now: float) -> bool:
        """An outage that has kept rows waiting ``destination_outage_max_wait``: from now on its
        nacks are charged (until an ack of it), and the rows parked behind its probe go."""
        p = self.p
        if not p.destinations.overdue(exchange, now):
            return False
        p.metrics.outages_overdue += 1
        log.warning(
            "exchange %r has refused every publish for %.0fs (OUTBOX_DESTINATION_OUTAGE_MAX_WAIT): "
            "its rows now spend their nack budget and end nacked after max_attempts",
            exchange,
            p.destinations.max_wait,
        )
        self.unpark(exchange)
        return True

    def _outage(self, exchange: str, ids: list[int], now: float, *, why: str = "") -> None:
        p = self.p
        reason = why or p.destinations.reason(exchange) or "nacks"
        delay, new = p.destinations.outage(exchange, reason, now)
        if self._overdue(exchange, now):  # it continues one that already waited its bound
            self._charge(ids)
            return
        if new:
            p.metrics.destination_outages += 1
            log.warning(
                "exchange %r is out (%s: a queue without a quorum, or full with "
                "reject-publish): paused, its rows wait without spending attempts for at most "
                "%.0fs; probing again in %.1fs",
                exchange,
                reason,
                p.destinations.max_wait,
                delay,
            )
        else:
            log.debug("exchange %r still out; probing again in %.1fs", exchange, delay)
        parked = [r.id for r in p.holdings.unpark(exchange)]
        self.outcomes().postpone(outage_reason(exchange, reason), delay, [*ids, *parked])
        p.wake.set()

    # ------------------------------------------------------------ verdicts on a timer

    def _arm(self) -> None:
        at = self.runs.next_due()
        if at is None or self._timer is not None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, at - self.p.clock()) + 0.01, self._verdicts)

    def _verdicts(self) -> None:
        self._timer = None
        now = self.p.clock()
        verdict = self.runs.due(now)
        self._charge(verdict.charged)
        for exchange, ids in verdict.outage.items():
            self._outage(
                exchange, ids, now, why=OUTAGE_WHY.format(n=len(ids), s=self.runs.outage_after)
            )
        self._arm()


def _by_exchange(
    ids: Sequence[int], exchange_of: Callable[[int], str | None]
) -> dict[str | None, list[int]]:
    out: dict[str | None, list[int]] = {}
    for row_id in ids:
        out.setdefault(exchange_of(row_id), []).append(row_id)
    return out
