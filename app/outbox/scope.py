"""Which rows an operator looks at or acts on: one value, one set of rules, for the REST API,
the CLI and the console alike (stdlib only: importing it loads no database driver).

:class:`Scope` is what a search shows; :class:`RepublishFilter` is a scope of terminal failures
that a republish moves. Every entry point builds its filter with :meth:`RepublishFilter.of`,
so "a filter that moves everything" and "a range that ends before it starts" are refused in one
place, and the words an operator reads before confirming (:meth:`Scope.describe`) and the
audit row (:meth:`RepublishFilter.as_json`) name every condition the rows were chosen by.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from app.outbox.states import TERMINAL_FAILURES, Status
from app.streams.names import StreamNameError, check_stream_name

#: A failure's cause is the first this many characters of its reason (``last_error``, else
#: ``reply_text``): the failures view groups by it, and a group's republish matches it exactly.
CAUSE_LENGTH = 500
#: The conditions besides statuses, in the order they are described.
CRITERIA = (
    "message_id",
    "batch_id",
    "exchange",
    "routing_key",
    "stream",
    "ordering_key",
    "reason",
    "cause",
    "created_after",
    "created_before",
)
_WORDS = {
    "message_id": "message",
    "batch_id": "batch",
    "exchange": "exchange",
    "routing_key": "routing key",
    "stream": "stream",
    "ordering_key": "ordering key",
    "reason": "reason containing",
    "cause": "reason",
}


class ScopeError(ValueError):
    """A filter that cannot be used as given (the message says what to change)."""


def _when(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True, slots=True)
class Scope:
    """Rows matching every given condition (``statuses`` empty: any status)."""

    statuses: frozenset[Status] = frozenset()
    #: one message (the republish of a message's own page)
    message_id: str | None = None
    batch_id: str | None = None
    exchange: str | None = None
    routing_key: str | None = None
    #: a RabbitMQ stream's rows (their ``exchange`` and ``routing_key`` are empty)
    stream: str | None = None
    ordering_key: str | None = None
    #: case-insensitive substring of ``last_error`` or ``reply_text`` (what a search types)
    reason: str | None = None
    #: the exact cause of a failures group: the first :data:`CAUSE_LENGTH` characters of
    #: ``coalesce(last_error, reply_text, '')`` ("" is the group of rows without a reason)
    cause: str | None = None
    created_after: dt.datetime | None = None  # inclusive
    created_before: dt.datetime | None = None  # exclusive

    def __post_init__(self) -> None:
        after, before = self.created_after, self.created_before
        for value in (after, before):
            if value is not None and value.tzinfo is None:
                raise ScopeError("created_after and created_before need a timezone")
        if after is not None and before is not None and after >= before:
            raise ScopeError("created_after must be earlier than created_before")
        if self.cause is not None and len(self.cause) > CAUSE_LENGTH:
            raise ScopeError(f"a cause is at most {CAUSE_LENGTH} characters")
        if self.stream is not None:
            try:
                check_stream_name(self.stream)
            except StreamNameError as exc:
                raise ScopeError(str(exc)) from None

    def criteria(self) -> dict[str, Any]:
        """The conditions given besides statuses."""
        return {n: getattr(self, n) for n in CRITERIA if getattr(self, n) is not None}

    def describe(self) -> str:
        """The filter in words, every condition named (what a preview states)."""
        parts = (
            [f"status {' or '.join(sorted(s.value for s in self.statuses))}"]
            if self.statuses
            else ["any status"]
        )
        for name, value in self.criteria().items():
            if name == "created_after":
                parts.append(f"written from {_when(value)}")
            elif name == "created_before":
                parts.append(f"written before {_when(value)}")
            elif name == "cause" and value == "":
                parts.append("no reason recorded")
            elif name == "exchange" and value == "":
                parts.append("the default exchange")
            elif name == "routing_key" and value == "":
                parts.append("an empty routing key")
            else:
                parts.append(f"{_WORDS[name]} {value!r}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class RepublishFilter(Scope):
    """Which terminal rows an operator moves back to ``pending``."""

    statuses: frozenset[Status] = TERMINAL_FAILURES

    def __post_init__(self) -> None:
        Scope.__post_init__(self)
        wrong = set(self.statuses) - TERMINAL_FAILURES
        if wrong or not self.statuses:
            names = ", ".join(sorted(s.value for s in TERMINAL_FAILURES))
            raise ScopeError(
                f"republish takes statuses among {names}; got {sorted(wrong) or 'none'}"
            )

    @classmethod
    def of(
        cls,
        *,
        statuses: Iterable[str] | None = None,
        everything: bool = False,
        **criteria: Any,
    ) -> RepublishFilter:
        """The filter of an operator's request. ``statuses`` None means all three terminal
        failures and is no filter by itself: a request that names no condition is refused
        unless it says ``everything``, so that an empty form never moves every failure."""
        unknown = set(criteria) - set(CRITERIA)
        if unknown:
            raise TypeError(f"unknown republish conditions: {sorted(unknown)}")
        given = {k: v for k, v in criteria.items() if v is not None}
        if statuses is None and not given and not everything:
            raise ScopeError(
                "say what to republish: a filter (status, batch, exchange, routing key, "
                'stream, ordering key, reason, message, created_after/created_before) or "all"'
            )
        try:
            chosen = TERMINAL_FAILURES if statuses is None else frozenset(map(Status, statuses))
        except ValueError as exc:
            raise ScopeError(f"unknown status: {exc}") from None
        return cls(statuses=chosen, **given)

    def as_json(self) -> dict[str, Any]:
        """As stored in the audit row: every condition. The five first fields are always
        there; the later ones only when set, so that audit rows written before they existed
        still compare equal and their request ids still replay."""
        doc: dict[str, Any] = {
            "batch_id": self.batch_id,
            "statuses": sorted(s.value for s in self.statuses),
            "exchange": self.exchange,
            "created_after": self.created_after.isoformat() if self.created_after else None,
            "created_before": self.created_before.isoformat() if self.created_before else None,
        }
        for name in ("message_id", "routing_key", "stream", "ordering_key", "reason", "cause"):
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        return doc
