"""A nacked outage probe drops the connection, at most every REFRESH_EVERY seconds per exchange
(pure: the outage logic with real parts, a fake clock, no loop, no socket)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from app.confirms import Nacked, Returned
from app.outbox.records import Backoff, ClaimedRow
from app.publisher.destinations import Destinations
from app.publisher.holdings import Holdings
from app.publisher.metrics import PublisherMetrics
from app.publisher.outages import REFRESH_EVERY, Outages
from app.publisher.outcomes import Outcomes
from app.publisher.settlement import Quarantine
from app.publisher.wakeup import Signal

EX = "orders"


def _row(row_id: int) -> ClaimedRow:
    return ClaimedRow(
        row_id, f"m{row_id}", "b", EX, "rk", False, b"x", None, None, None, None, 1, 10
    )


class Harness:
    def __init__(self) -> None:
        self.now = 0.0
        self.reconnects: list[float] = []
        self.unparked: list[str] = []
        self.destinations = Destinations(backoff=Backoff(base=0.1, cap=0.1))
        self.holdings = Holdings()
        self.outcomes = Outcomes()
        # the part of the publisher's shared state that outages read
        shared: Any = SimpleNamespace(
            destinations=self.destinations,
            holdings=self.holdings,
            quarantine=Quarantine(),
            metrics=PublisherMetrics(),
            wake=Signal(),
            clock=lambda: self.now,
            session=SimpleNamespace(reconnect=lambda reason: self.reconnects.append(self.now)),
        )
        self.outages = Outages(
            shared, outcomes=lambda: self.outcomes, unpark=self.unparked.append, burst=20
        )
        self.destinations.outage(EX, "nacks", 0.0)

    def probe_nacked(self, row_id: int, at: float) -> None:
        self.now = at
        self.holdings.held[row_id] = _row(row_id)
        self.destinations.probing(EX, row_id, at)
        self.outages.answered([Nacked(row_ids=(row_id,))])


def test_nacked_probes_refresh_the_connection_every_so_often_not_at_each() -> None:
    h = Harness()
    for i, at in enumerate([1.0, 2.0, 5.0, 1.0 + REFRESH_EVERY, 12.0, 2.0 + 2 * REFRESH_EVERY]):
        h.probe_nacked(i + 1, at)
    assert h.reconnects == [1.0, 1.0 + REFRESH_EVERY, 2.0 + 2 * REFRESH_EVERY]


def test_a_nacked_row_that_is_not_the_probe_does_not_reconnect() -> None:
    h = Harness()
    h.probe_nacked(1, 1.0)
    h.now = 30.0
    h.holdings.held[9] = _row(9)
    h.outages.answered([Nacked(row_ids=(9,))])  # the probe is 1, still out
    assert h.reconnects == [1.0]


def test_a_returned_probe_lets_another_go() -> None:
    """Found by the conformance suite: the outage's probe was a row with no binding; its return
    is no ack and no nack, and the exchange's parked rows waited for the probe for ever."""
    h = Harness()
    h.now = 1.0
    h.holdings.held[5] = _row(5)
    h.destinations.probing(EX, 5, 1.0)
    rest = h.outages.answered([Returned(5, "m5", 312, "NO_ROUTE")])
    assert rest == [Returned(5, "m5", 312, "NO_ROUTE")]  # settled as returned, as ever
    assert h.destinations.probe(EX) is None and h.unparked == [EX]  # another row probes


def test_a_probe_settled_any_other_way_lets_another_go() -> None:
    """Found by the conformance suite: the probe was returned and its channel closed, so its
    return came with the close; the write-back settled it ``returned`` and nobody cleared the
    probe. The write-back now hands every row it settles to ``Outages.lost``."""
    h = Harness()
    h.now = 1.0
    h.destinations.probing(EX, 7, 1.0)
    h.outages.lost(frozenset({3, 7}))
    assert h.destinations.probe(EX) is None and h.unparked == [EX]
    h.outages.lost(frozenset({7}))  # once cleared, nothing more happens
    assert h.unparked == [EX]
