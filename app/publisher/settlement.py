"""Settlement: the broker's answers and closes -> row outcomes. Pure decisions, no I/O.

The confirm ledger (:mod:`app.confirms`) turns frames into events per channel; this module
decides what each event means for the rows:

- ``Confirmed`` / ``Returned`` / ``Nacked``: straight into the outcome buffer.
- ``Lost`` (a channel or the connection went away): depends on *why* (:class:`CloseCause`):

  ========================  ==========================================================
  cause                     the lost rows
  ========================  ==========================================================
  PLAIN (network, timeout,  back to pending at once, a possible duplicate each
  our stop, forced close)
  DESTINATION (404 / 403    that exchange's rows back off (retry budget); the others
  naming an exchange)       as PLAIN
  OVERSIZED (406 over the   rows with bodies over the broker's limit fail; the others
  broker's max size)        as PLAIN
  UNEXPLAINED (any other    suspects: isolated by :class:`Quarantine` (below)
  channel close; a
  connection close for a
  frame or content error)
  ========================  ==========================================================

**Quarantine.** An unexplained close blames the rows that were outstanding on what closed (the
channel, or for a connection-level close the whole connection). Those rows stay held and are
published again *alone*, nothing else outstanding on the connection, as a group: a group that
is confirmed is innocent; a group that closes again is split in two, and each half goes alone in
turn. A single row that closes its channel or connection alone gets a strike; at
:data:`POISON_STRIKES` it ends ``failed`` with the broker's reason. So one bad row among a full
window of good ones is found in about log2(window) + 3 closes, and no good row is failed for
having shared a window with it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from app.amqp.errors import (
    ACCESS_REFUSED,
    CONTENT_ERRORS,
    NOT_FOUND,
    PRECONDITION_FAILED,
    CloseReason,
)
from app.confirms import Confirmed, Event, Lost, Nacked, Returned
from app.outbox.records import ReturnedRow
from app.publisher.outcomes import Outcomes

#: A row that alone closed its channel or connection this many times ends ``failed``.
POISON_STRIKES = 3
#: Strike counts of rows no longer around are dropped beyond this many entries.
MAX_STRIKE_ROWS = 100_000


class CloseKind(StrEnum):
    PLAIN = "plain"  # no blame: the network, a timeout, our own stop, a forced close
    DESTINATION = "destination"  # 404 no exchange / 403 access refused to an exchange
    OVERSIZED = "oversized"  # 406 message larger than the broker's max_message_size
    UNEXPLAINED = "unexplained"  # any other close by the broker: blame the outstanding rows


@dataclass(frozen=True, slots=True)
class CloseCause:
    """What a close tells the engine: whom to blame."""

    kind: CloseKind
    exchange: str | None = None
    max_size: int | None = None
    #: a DESTINATION close in the broker's words (``404 NOT_FOUND - no exchange 'x' ...``), with
    #: no channel number: rows of one missing exchange keep one reason, whichever channel closed
    reason: str = ""


PLAIN = CloseCause(CloseKind.PLAIN)
_EXCHANGE_IN_TEXT = re.compile(r"exchange '((?:[^'\\]|\\.)*)' in vhost")
_MAX_SIZE_IN_TEXT = re.compile(r"larger than configured max size (\d+)")


def classify_channel_close(reason: CloseReason) -> CloseCause:
    """Read the reply code and text of a broker ``channel.close``.

    ``NOT_FOUND - no exchange 'x' in vhost '/'`` and ``ACCESS_REFUSED - access to exchange 'x'
    in vhost '/' refused for user 'u'`` blame exchange ``x``; ``PRECONDITION_FAILED - message
    size 200 is larger than configured max size 100`` blames the bodies above 100 bytes; any
    other close by the broker blames the channel's outstanding publishes.
    """
    if not reason.by_peer:
        return PLAIN
    text = reason.reply_text
    if reason.reply_code in (NOT_FOUND, ACCESS_REFUSED):
        match = _EXCHANGE_IN_TEXT.search(text)
        if match is not None:
            return CloseCause(CloseKind.DESTINATION, exchange=match.group(1), reason=str(reason))
    if reason.reply_code == PRECONDITION_FAILED:
        match = _MAX_SIZE_IN_TEXT.search(text)
        if match is not None:
            return CloseCause(CloseKind.OVERSIZED, max_size=int(match.group(1)))
    return CloseCause(CloseKind.UNEXPLAINED)


def classify_connection_loss(reason: CloseReason) -> CloseCause:
    """A lost connection blames its publishes only when the broker closed it for a frame or a
    value it could not take (501-505); a dropped socket, a forced close (320), missed heartbeats
    or our own abort blame nobody."""
    if reason.by_peer and reason.reply_code in CONTENT_ERRORS:
        return CloseCause(CloseKind.UNEXPLAINED)
    return PLAIN


# ---------------------------------------------------------------------------- quarantine


@dataclass(slots=True)
class Quarantine:
    """Suspect rows, in groups waiting to be published alone (see the module docstring)."""

    strikes_to_fail: int = POISON_STRIKES
    groups: deque[list[int]] = field(default_factory=deque)
    active: set[int] = field(default_factory=set)
    strikes: dict[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.groups or self.active)

    def rows(self) -> set[int]:
        return {*self.active, *(i for g in self.groups for i in g)}

    def blame(self, suspects: Sequence[int]) -> tuple[list[int], list[int]]:
        """An unexplained close with ``suspects`` outstanding: returns (rows to publish again,
        rows that are poison). One suspect alone takes a strike; several are split in two."""
        self.active.difference_update(suspects)
        if not suspects:
            return [], []
        if len(suspects) > 1:
            half = len(suspects) // 2
            self.groups.extendleft([list(suspects[half:]), list(suspects[:half])])
            return list(suspects), []
        row = suspects[0]
        self.strikes[row] = self.strikes.get(row, 0) + 1
        if self.strikes[row] >= self.strikes_to_fail:
            self.strikes.pop(row)
            return [], [row]
        self.groups.appendleft([row])
        return [row], []

    def requeue(self, ids: Sequence[int]) -> None:
        """Rows of the active group lost with nobody to blame go again, unchanged."""
        self.active.difference_update(ids)
        if ids:
            self.groups.appendleft(list(ids))

    def take(self) -> list[int] | None:
        """The next group to publish alone (it becomes the active group), or None."""
        if self.active or not self.groups:
            return None
        group = self.groups.popleft()
        self.active = set(group)
        return group

    def settled(self, ids: Iterable[int]) -> None:
        """Rows the broker answered for (acked, nacked, returned): innocent."""
        if self.active:
            self.active.difference_update(ids)
        if self.strikes:
            for row in ids:
                self.strikes.pop(row, None)
            if len(self.strikes) > MAX_STRIKE_ROWS:
                self.strikes.clear()

    def drop(self, ids: Iterable[int]) -> None:
        """Forget rows (released on stop, lease lost)."""
        gone = set(ids)
        self.active -= gone
        self.groups = deque(kept for g in self.groups if (kept := [i for i in g if i not in gone]))


# ---------------------------------------------------------------------------- settlement


class HeldRow(Protocol):
    """What settlement needs to know of a held row."""

    @property
    def exchange(self) -> str: ...

    @property
    def body(self) -> bytes: ...


@dataclass(slots=True)
class Tally:
    """What one settlement did, for counters and log lines."""

    confirmed: int = 0
    returned: int = 0
    nacked: int = 0
    lost: int = 0
    resent: list[int] = field(default_factory=list)
    poison: list[int] = field(default_factory=list)
    oversized: int = 0
    paused: str | None = None
    paused_reason: str = ""


def settle(events: Sequence[Event], out: Outcomes, quarantine: Quarantine) -> Tally:
    """The broker answered (``basic.ack`` / ``basic.nack``): outcomes for the rows."""
    tally = Tally()
    for event in events:
        if isinstance(event, Confirmed):
            out.confirmed.extend(event.row_ids)
            if event.sent:
                out.sent.update(zip(event.row_ids, event.sent, strict=True))
            tally.confirmed += len(event.row_ids)
            quarantine.settled(event.row_ids)
        elif isinstance(event, Returned):
            _returned(event, out, tally, quarantine)
        elif isinstance(event, Nacked):
            out.nacked.extend(event.row_ids)
            tally.nacked += len(event.row_ids)
            quarantine.settled(event.row_ids)
    return tally


def _returned(event: Returned, out: Outcomes, tally: Tally, quarantine: Quarantine) -> None:
    out.returned.append(ReturnedRow(event.row_id, event.reply_code, event.reply_text))
    if event.sent is not None:
        out.sent[event.row_id] = event.sent
    tally.returned += 1
    quarantine.settled((event.row_id,))


#: The reply code of a mandatory publish no queue is bound for (``basic.return``).
NO_ROUTE = 312


def early_returns(events: Sequence[Event], *, in_grace: bool) -> tuple[list[Event], list[Returned]]:
    """Split out the ``312 NO_ROUTE`` returns that came within the return grace of a connection
    (``in_grace``): after a broker restart a durable queue's binding may not be recovered yet
    when the broker takes connections again, so such a return says "not ready", not
    "unroutable". Returns (the other events, the early returns)."""
    if not in_grace:
        return list(events), []
    rest: list[Event] = []
    early: list[Returned] = []
    for event in events:
        if isinstance(event, Returned) and event.reply_code == NO_ROUTE:
            early.append(event)
        else:
            rest.append(event)
    return rest, early


def early_return_reason(event: Returned, grace: float) -> str:
    """The reason kept on a row whose return came within the grace: retried, nothing spent."""
    return (
        f"returned {event.reply_code} {event.reply_text} within {grace:g}s of connecting "
        "(the broker may still be recovering its bindings): published again"
    )


def lose(
    events: Sequence[Event],
    out: Outcomes,
    *,
    cause: CloseCause,
    rows: Mapping[int, HeldRow],
    quarantine: Quarantine,
) -> Tally:
    """A channel or the connection went away with publishes outstanding: outcomes by cause."""
    tally = Tally()
    for event in events:
        if isinstance(event, Returned):  # returned before the close: the return stands
            _returned(event, out, tally, quarantine)
        elif isinstance(event, Lost):
            _lost(event, out, tally, cause=cause, rows=rows, quarantine=quarantine)
    return tally


def destination_reason(exchange: str, broker: str) -> str:
    """The reason kept on a row of a missing or forbidden exchange: the same words whichever
    path saw it last (the passive check, the exchange paused, a channel the broker closed), so
    ``outbox failures`` shows one cause as one group."""
    return f"exchange {exchange!r}: {broker}"


def outage_reason(exchange: str, why: str) -> str:
    """The reason kept on a row put back for its destination's outage (no budget spent)."""
    return f"exchange {exchange!r} out: {why}; waiting, no attempt spent"


def oversized_reason(max_size: int) -> str:
    """The reason of a row whose body is over the broker's ``max_message_size``."""
    return f"body larger than the broker's max_message_size ({max_size} bytes)"


def _lost(
    event: Lost,
    out: Outcomes,
    tally: Tally,
    *,
    cause: CloseCause,
    rows: Mapping[int, HeldRow],
    quarantine: Quarantine,
) -> None:
    ids = list(event.row_ids)
    if cause.kind is CloseKind.DESTINATION and cause.exchange is not None:
        mine = [i for i in ids if _exchange(rows, i) == cause.exchange]
        ids = [i for i in ids if _exchange(rows, i) != cause.exchange]
        broker = cause.reason or event.reason
        tally.paused, tally.paused_reason = cause.exchange, broker
        if mine:
            out.back_off(destination_reason(cause.exchange, broker), mine)
            quarantine.drop(mine)
    elif cause.kind is CloseKind.OVERSIZED and cause.max_size is not None:
        big = [i for i in ids if _size(rows, i) > cause.max_size]
        ids = [i for i in ids if _size(rows, i) <= cause.max_size]
        if big:
            out.fail(oversized_reason(cause.max_size), big)
            quarantine.drop(big)
            tally.oversized += len(big)
    elif cause.kind is CloseKind.UNEXPLAINED:
        again, poison = quarantine.blame(ids)
        if again:
            out.resend(f"suspect in an unexplained close: {event.reason}", again)
            tally.resent += again
        if poison:
            why = (
                f"closed its channel or connection alone {quarantine.strikes_to_fail} "
                f"times: {event.reason}"
            )
            out.fail(why, poison)
            tally.poison += poison
        return
    _lost_plainly(ids, event.reason, out, tally, quarantine)


def _lost_plainly(
    ids: list[int], reason: str, out: Outcomes, tally: Tally, quarantine: Quarantine
) -> None:
    """Nobody to blame: rows of the active quarantine group go alone again; the rest are
    released to be published again (possible duplicates)."""
    if quarantine.active:
        suspects = [i for i in ids if i in quarantine.active]
        if suspects:
            quarantine.requeue(suspects)
            out.resend(reason, suspects)
            tally.resent += suspects
            ids = [i for i in ids if i not in quarantine.active and i not in suspects]
    if ids:
        out.lose(reason, ids)
        tally.lost += len(ids)


def _exchange(rows: Mapping[int, HeldRow], row_id: int) -> str | None:
    row = rows.get(row_id)
    return row.exchange if row is not None else None


def _size(rows: Mapping[int, HeldRow], row_id: int) -> int:
    row = rows.get(row_id)
    return len(row.body) if row is not None else 0
