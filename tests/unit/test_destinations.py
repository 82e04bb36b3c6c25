"""Destination outages are bounded (pure): an outage keeps rows waiting without spending their
nack budget for at most ``outage_max_wait``, counted from its start across short recoveries;
then its nacks are charged until an ack of it."""

from __future__ import annotations

import random

from app.outbox.records import Backoff
from app.publisher.destinations import FLAP_MEMORY, Destinations, DestinationState


def _destinations(max_wait: float = 100.0) -> Destinations:
    return Destinations(
        backoff=Backoff(base=1.0, cap=8.0, rng=random.Random(1)), outage_max_wait=max_wait
    )


def test_an_outage_past_its_bound_charges_until_an_ack() -> None:
    d = _destinations(max_wait=100.0)
    d.outage("ex", "nacks", now=0.0)
    assert d.in_outage("ex") and not d.overdue("ex", now=99.0)
    assert d.overdue("ex", now=100.0)
    assert not d.in_outage("ex") and d.charging("ex")
    assert d.state("ex", now=100.0) is DestinationState.OK  # its rows go out, and are charged
    d.ok("ex", now=170.0)  # a passive re-check: still charging
    assert d.charging("ex")
    assert d.recovered("ex", now=180.0) is None  # an ack: judged by the rule again
    assert not d.charging("ex")


def test_an_outage_that_begins_again_soon_continues_the_last_one() -> None:
    """A destination that takes a probe now and then and refuses the rest: each recovery would
    start the bound again, so rows could wait for ever. The outage continues; the time between
    does not count."""
    d = _destinations(max_wait=100.0)
    d.outage("ex", "nacks", now=0.0)
    assert d.recovered("ex", now=60.0) == 60.0
    delay, new = d.outage("ex", "nacks", now=70.0)
    assert new and delay >= 1.0  # the pause goes on growing: failures continued
    assert d.outage_age("ex", now=70.0) == 60.0
    assert not d.overdue("ex", now=109.0)
    assert d.overdue("ex", now=110.0)


def test_a_long_healthy_spell_forgets_the_last_outage() -> None:
    d = _destinations(max_wait=100.0)
    d.outage("ex", "nacks", now=0.0)
    d.recovered("ex", now=90.0)
    d.outage("ex", "nacks", now=90.0 + FLAP_MEMORY)
    assert d.outage_age("ex", now=90.0 + FLAP_MEMORY) == 0.0
