"""Outbox row states and the legal transitions between them, kept as data.

::

    pending ──claim──▶ in_flight ──ack──────────▶ confirmed
       ▲                  │  ├──return─────────▶ returned ─┐
       │                  │  ├──nack, spent────▶ nacked   ─┤ operator
       │                  │  └──permanent error▶ failed   ─┤ republish
       └──retry / lost / lease expired / release ◀──┘      │
       ▲                                                   │
       └───────────────────────────────────────────────────┘   operator skip ─▶ skipped

``skipped`` is an operator's decision that a terminal failure will not be delivered: the row
stays (audited), and the later rows of its ordering key, parked behind it, go on.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    CONFIRMED = "confirmed"
    RETURNED = "returned"
    NACKED = "nacked"
    FAILED = "failed"
    SKIPPED = "skipped"


_FAILURE_ORDER = (Status.RETURNED, Status.NACKED, Status.FAILED)
TERMINAL_FAILURES: frozenset[Status] = frozenset(_FAILURE_ORDER)
TERMINAL: frozenset[Status] = TERMINAL_FAILURES | {Status.CONFIRMED, Status.SKIPPED}
#: A row in one of these states no longer holds back the later rows of its ordering key.
RELEASES_KEY: frozenset[Status] = frozenset({Status.CONFIRMED, Status.SKIPPED})

#: (from, to) -> the event that moves a row along that edge.
TRANSITIONS: dict[tuple[Status, Status], str] = {
    (Status.PENDING, Status.IN_FLIGHT): "claim",
    (Status.IN_FLIGHT, Status.CONFIRMED): "ack",
    (Status.PENDING, Status.CONFIRMED): "an ack written again after a failover undid it",
    (Status.IN_FLIGHT, Status.RETURNED): "return",
    (Status.IN_FLIGHT, Status.NACKED): "nack, attempts spent",
    (Status.IN_FLIGHT, Status.FAILED): "permanent error",
    (Status.IN_FLIGHT, Status.PENDING): "retry, lost confirm, expired lease or release",
    # a stream that does not exist past the retry budget: its rows waiting for a claim
    (Status.PENDING, Status.FAILED): "stream missing past the retry budget",
    # an operator moves a terminal failure back (republish) or past (skip)
    **{(s, Status.PENDING): "operator republish" for s in _FAILURE_ORDER},
    **{(s, Status.SKIPPED): "operator skip" for s in _FAILURE_ORDER},
}


class IllegalTransition(ValueError):
    """A caller asked for a state change that the table above does not allow."""

    def __init__(self, source: Status, target: Status) -> None:
        super().__init__(f"illegal outbox transition {source.value} -> {target.value}")
        self.source = source
        self.target = target


def check_transition(source: Status | str, target: Status | str) -> str:
    """Return the event name of a legal edge; raise :class:`IllegalTransition` otherwise."""
    edge = (Status(source), Status(target))
    try:
        return TRANSITIONS[edge]
    except KeyError:
        raise IllegalTransition(*edge) from None
