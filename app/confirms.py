"""Sans-IO publisher-confirm ledger: delivery tag <-> outbox row for one confirm-mode channel.

- After ``confirm.select`` each publish on the channel gets the next delivery tag: 1, 2, 3, ...
- ``basic.ack`` / ``basic.nack`` settle one tag, or with ``multiple=True`` every outstanding tag
  up to and including it. Acks may arrive out of order; no publish is both acked and nacked.
- Tag 0 with ``multiple=True`` means "all outstanding" (AMQP 0-9-1, ``basic.ack``): it settles
  every outstanding tag, or nothing when none is. Tag 0 alone names no publish: an error.
- A mandatory, unroutable publish gets ``basic.return`` (no tag: matched by ``message_id``, which
  must be unique among the channel's in-flight publishes) *before* its ack. That ack settles it
  as ``Returned``, never ``Confirmed``.
- Channel loss: every outstanding publish is of unknown outcome (``Lost``); one already returned
  settles as ``Returned``.

The ledger is the one record of a publish: where (channel, tag) and when (monotonic and wall
clock) each row went out. ``Confirmed`` and ``Returned`` carry those facts with the rows they
settle (the publisher writes them to the rows), and :meth:`ChannelLedger.due_notes` answers
which publishes are still unconfirmed past a deadline (an operator sees them as outstanding).

No I/O: feed it publishes and broker frames, act on the events it returns. Errors are split by
blame (h11 style)::

    LedgerError
    ├── LocalProtocolError       we misused the ledger; state untouched
    └── RemoteProtocolError      the broker sent something impossible; counted, state untouched
        ├── UnknownDeliveryTag   ack/nack of a tag that is not outstanding
        └── UnknownReturn        basic.return of a message_id that is not outstanding
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

#: Where and when a row went out: (channel id, delivery tag, wall-clock time, monotonic time).
Sent: TypeAlias = tuple[int, int, "dt.datetime | None", float]
#: Publishes still unconfirmed past their deadline: (channel id, wall-clock publish time) ->
#: [(row id, delivery tag)], what the publisher writes on those rows.
TagNoteMap: TypeAlias = dict[tuple[int, "dt.datetime | None"], list[tuple[int, int]]]

# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The broker acked these rows and did not return them (tag order); ``sent`` holds each
    row's publish facts, in the same order."""

    row_ids: tuple[int, ...]
    sent: tuple[Sent, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class Nacked:
    """The broker nacked these rows (tag order); they may be published again."""

    row_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Returned:
    """The broker returned this mandatory publish as unroutable; emitted when it settles."""

    row_id: int
    message_id: str
    reply_code: int
    reply_text: str
    sent: Sent | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Lost:
    """The channel went away before these rows settled: outcome unknown (tag order)."""

    row_ids: tuple[int, ...]
    reason: str


Event: TypeAlias = Confirmed | Nacked | Returned | Lost

# ---------------------------------------------------------------- errors


class LedgerError(Exception):
    """Base of every ledger error."""


class LocalProtocolError(LedgerError):
    """Our own misuse: a message_id already in flight, a publish after channel loss, ..."""


class RemoteProtocolError(LedgerError):
    """The broker sent a frame that cannot happen; the ledger counts it and stays unchanged."""


class UnknownDeliveryTag(RemoteProtocolError):
    """basic.ack/nack of a tag never published on this channel, or already settled."""

    def __init__(self, *, channel_id: int, tag: int, multiple: bool) -> None:
        super().__init__(
            f"channel {channel_id}: unknown or settled delivery tag {tag} (multiple={multiple})"
        )
        self.channel_id = channel_id
        self.tag = tag
        self.multiple = multiple


class UnknownReturn(RemoteProtocolError):
    """basic.return of a message_id not outstanding on this channel (or returned twice)."""

    def __init__(self, *, channel_id: int, message_id: str) -> None:
        super().__init__(f"channel {channel_id}: basic.return of unknown message_id {message_id!r}")
        self.channel_id = channel_id
        self.message_id = message_id


# ---------------------------------------------------------------- ledger

_Run: TypeAlias = tuple[float, "dt.datetime | None"]  # (monotonic, wall-clock) of one publish write
_Entry: TypeAlias = tuple[int, str, _Run]  # (row_id, message_id, its publish write)
_Taken: TypeAlias = list[tuple[int, _Entry]]  # settled (tag, entry) pairs, tag order


class ChannelLedger:
    """Outstanding publishes of one confirm-mode channel, keyed by delivery tag.

    Tags are contiguous, so a low-water pointer (``_low``: the lowest outstanding tag, or
    ``next_tag`` when none is) makes every settle O(1) amortised: a multiple ack sweeps
    ``_low..tag`` once and the pointer never moves back.
    """

    __slots__ = (
        "_at_runs",
        "_by_message",
        "_closed",
        "_entries",
        "_low",
        "_next_tag",
        "_noted",
        "_protocol_errors",
        "_returns",
        "channel_id",
    )

    def __init__(self, *, channel_id: int) -> None:
        self.channel_id = channel_id
        self._next_tag = 1
        self._low = 1
        self._entries: dict[int, _Entry] = {}  # outstanding tag -> entry, in tag order
        self._by_message: dict[str, int] = {}  # outstanding message_id -> tag
        self._returns: dict[int, tuple[int, str]] = {}  # returned tag -> (reply code, text)
        # (first tag, at, wall) of publish writes, from the one holding the lowest outstanding tag
        self._at_runs: deque[tuple[int, float, dt.datetime | None]] = deque()
        self._noted = 1  # the first tag :meth:`due_notes` has not looked at yet
        self._protocol_errors = 0
        self._closed = False

    @property
    def next_tag(self) -> int:
        """The delivery tag the next publish gets."""
        return self._next_tag

    @property
    def outstanding(self) -> int:
        """How many publishes are not settled yet."""
        return len(self._entries)

    @property
    def protocol_errors(self) -> int:
        """How many RemoteProtocolErrors this ledger raised."""
        return self._protocol_errors

    @property
    def closed(self) -> bool:
        """True once channel_lost() ran; the ledger takes no more publishes."""
        return self._closed

    # ------------------------------------------------------------ publishes

    def published(
        self, *, row_id: int, message_id: str, at: float = 0.0, wall: dt.datetime | None = None
    ) -> int:
        """Register one publish written at monotonic ``at`` (wall clock ``wall``); return its
        delivery tag."""
        self._check_open()
        if message_id in self._by_message:
            raise LocalProtocolError(f"message_id {message_id!r} is already in flight")
        tag = self._next_tag
        self._entries[tag] = (row_id, message_id, (at, wall))
        self._by_message[message_id] = tag
        self._note_at(tag, at, wall)
        self._next_tag = tag + 1
        return tag

    def published_many(
        self, rows: Sequence[tuple[int, str]], *, at: float = 0.0, wall: dt.datetime | None = None
    ) -> range:
        """Register ``(row_id, message_id)`` publishes of one write, in order; return their
        (contiguous) tags.

        All or nothing: a duplicate message_id raises LocalProtocolError and registers none.
        """
        self._check_open()
        message_ids = [message_id for _, message_id in rows]
        self._check_fresh(message_ids)
        tags = range(self._next_tag, self._next_tag + len(rows))
        run = (at, wall)
        self._entries.update(zip(tags, [(r, m, run) for r, m in rows], strict=True))
        self._by_message.update(zip(message_ids, tags, strict=True))
        if tags:
            self._note_at(tags.start, at, wall)
        self._next_tag = tags.stop
        return tags

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError(f"channel {self.channel_id} ledger is closed (channel lost)")

    def _check_fresh(self, message_ids: list[str]) -> None:
        fresh = set(message_ids)  # probe the map per batch row: never iterate the in-flight map
        if len(fresh) == len(message_ids) and self._by_message.keys().isdisjoint(fresh):
            return
        taken = sorted(fresh & self._by_message.keys()) or "repeated within the batch"
        raise LocalProtocolError(f"message_id already in flight: {taken}")

    def _note_at(self, tag: int, at: float, wall: dt.datetime | None) -> None:
        if not self._at_runs or self._at_runs[-1][1] != at:
            self._at_runs.append((tag, at, wall))

    # ------------------------------------------------------------ broker frames

    def ack(self, tag: int, *, multiple: bool = False) -> list[Event]:
        """basic.ack: one Confirmed for the plain rows, one Returned per returned row."""
        return self._settle(tag, multiple, lambda rows, sent: Confirmed(row_ids=rows, sent=sent))

    def nack(self, tag: int, *, multiple: bool = False) -> list[Event]:
        """basic.nack: one Nacked for the plain rows, one Returned per returned row.

        A returned row settles as Returned even when nacked: the broker already said it routes
        nowhere, so retrying it as a nack would only return it again.
        """
        return self._settle(tag, multiple, lambda rows, _: Nacked(row_ids=rows))

    def returned(self, *, message_id: str, reply_code: int, reply_text: str) -> list[Event]:
        """basic.return: remember it; the ack or nack that follows settles the row as Returned.

        Always returns ``[]``; raises UnknownReturn for a message_id not outstanding or
        already returned.
        """
        tag = self._by_message.get(message_id)
        if tag is None or tag in self._returns:
            self._protocol_errors += 1
            raise UnknownReturn(channel_id=self.channel_id, message_id=message_id)
        self._returns[tag] = (reply_code, reply_text)
        return []

    def channel_lost(self, *, reason: str) -> list[Event]:
        """The channel closed: Lost for outstanding rows, Returned for returned ones.

        Closes the ledger. Calling it again returns ``[]``.
        """
        if self._closed:
            return []
        self._closed = True
        plain, _, returned = self._split(list(self._entries.items()))
        self._entries.clear()
        self._at_runs.clear()
        self._low = self._noted = self._next_tag
        return [Lost(row_ids=plain, reason=reason), *returned] if plain else returned

    def _settle(
        self, tag: int, multiple: bool, group: Callable[[tuple[int, ...], tuple[Sent, ...]], Event]
    ) -> list[Event]:
        if multiple and tag == 0:  # "all outstanding": through the last tag published
            if not self._entries:
                return []
            tag = self._next_tag - 1
        if not self._settleable(tag, multiple):
            self._protocol_errors += 1
            raise UnknownDeliveryTag(channel_id=self.channel_id, tag=tag, multiple=multiple)
        taken = self._take_through(tag) if multiple else [(tag, self._entries.pop(tag))]
        self._advance_low()
        plain, sent, returned = self._split(taken)
        return [group(plain, sent), *returned] if plain else returned

    def _settleable(self, tag: int, multiple: bool) -> bool:
        if multiple:  # some outstanding tag <= tag, and tag was published
            return self._low <= tag < self._next_tag
        return tag in self._entries

    def _take_through(self, tag: int) -> _Taken:
        pop = self._entries.pop
        return [(t, e) for t in range(self._low, tag + 1) if (e := pop(t, None)) is not None]

    def _advance_low(self) -> None:
        low, entries = self._low, self._entries
        while low < self._next_tag and low not in entries:
            low += 1
        self._low = low
        self._prune_at_runs()

    def _prune_at_runs(self) -> None:
        runs = self._at_runs
        while len(runs) > 1 and runs[1][0] <= self._low:
            runs.popleft()

    def _split(self, taken: _Taken) -> tuple[tuple[int, ...], tuple[Sent, ...], list[Event]]:
        """Forget settled entries; return plain row ids, their publish facts and the Returned
        events, in tag order."""
        by_message, returns, channel = self._by_message, self._returns, self.channel_id
        plain: list[int] = []
        sent: list[Sent] = []
        returned: list[Event] = []
        for tag, (row_id, message_id, (at, wall)) in taken:
            del by_message[message_id]
            reply = returns.pop(tag, None) if returns else None
            if reply is None:
                plain.append(row_id)
                sent.append((channel, tag, wall, at))
            else:
                returned.append(
                    Returned(row_id, message_id, reply[0], reply[1], (channel, tag, wall, at))
                )
        return tuple(plain), tuple(sent), returned

    # ------------------------------------------------------------ queries

    def oldest_outstanding_at(self) -> float | None:
        """The ``at`` of the earliest-published unsettled publish (lowest tag), or None."""
        if not self._entries:
            return None
        self._prune_at_runs()
        return self._at_runs[0][1]

    def row_for_tag(self, tag: int) -> int | None:
        """The row id of an outstanding tag, or None."""
        entry = self._entries.get(tag)
        return None if entry is None else entry[0]

    def due_notes(self, cutoff: float, into: TagNoteMap) -> int:
        """Add to ``into`` every publish written at or before ``cutoff`` (monotonic) that is
        still unconfirmed and was not reported by an earlier call; return how many.

        Each publish is looked at once: a later call starts where this one stopped, so the
        cost is the publishes that became due since, not all that are outstanding."""
        first_at = self.next_note_at()
        if first_at is None or first_at > cutoff:  # the usual case: nothing new is due
            return 0
        start = max(self._noted, self._low)
        runs, entries, channel = list(self._at_runs), self._entries, self.channel_id
        noted = 0
        for i, (first, at, wall) in enumerate(runs):
            if at > cutoff:
                break
            end = runs[i + 1][0] if i + 1 < len(runs) else self._next_tag
            if end <= start:
                continue
            found = [
                (e[0], t)
                for t in range(max(first, start), end)
                if (e := entries.get(t)) is not None
            ]
            if found:
                into.setdefault((channel, wall), []).extend(found)
                noted += len(found)
            start = end
        self._noted = start
        return noted

    def next_note_at(self) -> float | None:
        """When (monotonic ``at`` of its write) the first publish not yet looked at by
        :meth:`due_notes` was written; None when there is none."""
        start = max(self._noted, self._low)
        if start >= self._next_tag or not self._at_runs:
            return None
        found = None
        for first, at, _ in self._at_runs:
            if first > start:
                break
            found = at
        return found
