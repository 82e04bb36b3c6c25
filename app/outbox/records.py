"""The values the publisher and the outbox store hand each other: plain records, no I/O.

Kept apart from the store that reads and writes them (``app.outbox.store``), as an event
store keeps its records apart from its recorders: the pure parts of the publisher (settlement,
holdings, envelopes, destinations) import these and nothing of SQLAlchemy or a driver. Standard
library only; ``tests/unit/test_pure_imports.py`` holds it to that.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class ClaimedRow(NamedTuple):
    """A row this publisher now holds ``in_flight`` under its lease.

    A named tuple, not a frozen dataclass: a claim builds one per row, on the claim's path, and
    a frozen dataclass sets each field through ``object.__setattr__``, several times the cost of
    building a tuple."""

    id: int
    message_id: str
    batch_id: str
    exchange: str
    routing_key: str
    mandatory: bool
    body: bytes
    content_type: str | None
    #: JSON text as stored, checked by the publisher row by row (``app.outbox.content``): a
    #: hostile document must fail its own row, never the claim that read it.
    headers: str | dict[str, Any] | None
    properties: str | dict[str, Any] | None
    ordering_key: str | None
    attempts: int
    max_attempts: int


class Published(NamedTuple):
    """Where and when a held row was published: written with its outcome, in one statement.
    A named tuple (one per confirmed row), like :class:`ClaimedRow`."""

    id: int
    channel_id: int
    delivery_tag: int
    published_at: dt.datetime


@dataclass(frozen=True, slots=True)
class ReturnedRow:
    id: int
    reply_code: int
    reply_text: str


@dataclass(frozen=True, slots=True)
class RetryOutcome:
    retried: int
    exhausted: int


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff, jittered within [d/2, d] where d = ``base * 2**(attempt-1)``, capped."""

    base: float = 0.5
    cap: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, attempt: int) -> float:
        ceiling = min(self.cap, self.base * (2 ** max(0, attempt - 1)))
        return float(ceiling * (0.5 + 0.5 * self.rng.random()))
