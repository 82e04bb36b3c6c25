"""Which exchanges are known to exist, which are backing off, and until when. Pure, no I/O.

An exchange is checked (passive ``exchange.declare`` on a scratch channel) the first time the
publisher sees it and again once its entry expires, so a row for a missing exchange never kills
the channel the other rows are flowing on. A missing or forbidden exchange backs off
exponentially; only its own rows wait.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum

from app.outbox.records import Backoff

DEFAULT_EXCHANGE = ""
#: An outage that begins again within this many seconds of the last one's end continues it
#: (its pause, and its age towards ``outage_max_wait``, the time between not counted).
FLAP_MEMORY = 60.0


class DestinationState(StrEnum):
    OK = "ok"  # exists (checked recently): publish
    UNKNOWN = "unknown"  # never checked or entry expired: check first
    CHECKING = "checking"  # a check is running: park the rows
    PAUSED = "paused"  # missing or forbidden: back off, rows retry later
    OUTAGE = "outage"  # nacks everything (no quorum, full): rows wait, budgets untouched
    PROBING = "probing"  # an outage's pause is over: one row goes, the rest wait for its ack


@dataclass(slots=True)
class _Entry:
    state: DestinationState
    until: float
    failures: int = 0
    reason: str = ""
    since: float = 0.0  # an outage: when it began (kept through its probes)
    probe: int | None = None  # an outage: the row published as its probe, in flight
    #: an outage past its bound: publishable, and every nack of it is charged to its row
    charging: bool = False


@dataclass(frozen=True, slots=True)
class _Ended:
    """An outage that ended (an ack, or past its bound), remembered a while: one that begins
    again soon after continues it (its start and its pause), so a destination that takes a
    probe now and then and refuses the rest cannot keep rows waiting past the bound."""

    at: float
    since: float
    failures: int


class Destinations:
    """Per-exchange state with expiry; ``now`` is a monotonic clock passed in by the caller."""

    def __init__(
        self, *, backoff: Backoff, ok_ttl: float = 60.0, outage_max_wait: float = 300.0
    ) -> None:
        self._backoff = backoff
        self._ok_ttl = ok_ttl
        self.max_wait = outage_max_wait
        self._entries: dict[str, _Entry] = {}
        self._ended: dict[str, _Ended] = {}

    def state(self, exchange: str, now: float) -> DestinationState:
        if exchange == DEFAULT_EXCHANGE:
            return DestinationState.OK
        entry = self._entries.get(exchange)
        if entry is None:
            return DestinationState.UNKNOWN
        if entry.state is DestinationState.CHECKING or now < entry.until:
            return entry.state
        if entry.state in (DestinationState.OUTAGE, DestinationState.PROBING):
            return DestinationState.PROBING
        return DestinationState.UNKNOWN

    def reason(self, exchange: str) -> str:
        entry = self._entries.get(exchange)
        return entry.reason if entry is not None else ""

    def checking(self, exchange: str) -> None:
        entry = self._entries.get(exchange)
        failures = entry.failures if entry is not None else 0
        self._entries[exchange] = _Entry(DestinationState.CHECKING, 0.0, failures)

    def clear(self) -> None:
        """A new connection: checks in flight on the old one will never answer."""
        self._entries = {
            k: e for k, e in self._entries.items() if e.state is not DestinationState.CHECKING
        }

    def ok(self, exchange: str, now: float) -> None:
        """The exchange exists (checked). An outage past its bound keeps charging its nacks:
        only an ack ends that (:meth:`recovered`)."""
        entry = self._entries.get(exchange)
        charging = entry is not None and entry.charging
        self._entries[exchange] = _Entry(DestinationState.OK, now + self._ok_ttl, charging=charging)

    def unchecked(self, exchange: str, now: float) -> float:
        """A check could not run (no connection, no channel, a timeout): its rows stay parked
        and the check runs again after a backoff (returned, in seconds), never in a loop."""
        entry = self._entries.get(exchange)
        failures = (entry.failures if entry is not None else 0) + 1
        delay = self._backoff.delay(failures)
        self._entries[exchange] = _Entry(
            DestinationState.CHECKING, now + delay, failures, "check did not run"
        )
        return delay

    def recheck(self, exchange: str) -> None:
        """The backoff after a check that did not run is over: check again."""
        entry = self._entries.get(exchange)
        if entry is not None and entry.state is DestinationState.CHECKING:
            self._entries[exchange] = _Entry(DestinationState.UNKNOWN, 0.0, entry.failures)

    def failed(self, exchange: str, reason: str, now: float) -> float:
        """The exchange is missing or forbidden: pause it; returns the pause in seconds."""
        entry = self._entries.get(exchange)
        failures = (entry.failures if entry is not None else 0) + 1
        delay = self._backoff.delay(failures)
        self._entries[exchange] = _Entry(DestinationState.PAUSED, now + delay, failures, reason)
        return delay

    def paused(self, now: float) -> dict[str, float]:
        """Exchanges backing off or in an outage now -> seconds left (0: probing)."""
        out = {
            name: max(0.0, entry.until - now)
            for name, entry in self._entries.items()
            if entry.state is DestinationState.OUTAGE
        }
        out.update(
            (name, entry.until - now)
            for name, entry in self._entries.items()
            if entry.state is DestinationState.PAUSED and now < entry.until
        )
        return out

    # ------------------------------------------------------------ outages (nacks everything)

    def in_outage(self, exchange: str) -> bool:
        entry = self._entries.get(exchange)
        return entry is not None and entry.state in (
            DestinationState.OUTAGE,
            DestinationState.PROBING,
        )

    def outage(self, exchange: str, reason: str, now: float) -> tuple[float, bool]:
        """The exchange nacks everything: pause it. Returns (the pause in seconds, whether this
        begins a new outage: False when a probe failed or late nacks of the same came)."""
        entry = self._entries.get(exchange)
        ongoing = entry is not None and entry.state in (
            DestinationState.OUTAGE,
            DestinationState.PROBING,
        )
        if ongoing and entry is not None and entry.state is DestinationState.OUTAGE:
            return max(0.0, entry.until - now), False  # late nacks of the same outage
        if ongoing and entry is not None:
            failures, since = entry.failures, entry.since
        else:
            ended = self._ended.pop(exchange, None)
            if ended is not None and now - ended.at < FLAP_MEMORY:
                # the time it took rows between the two does not count towards the bound
                failures, since = ended.failures, ended.since + (now - ended.at)
            else:
                failures, since = 0, now
        delay = self._backoff.delay(failures + 1)
        self._entries[exchange] = _Entry(
            DestinationState.OUTAGE, now + delay, failures + 1, reason, since
        )
        return delay, not ongoing

    def overdue(self, exchange: str, now: float) -> bool:
        """Has this exchange's outage (counted from its start, across flaps) lasted
        ``outage_max_wait``? Then it ends: the exchange is publishable, and its nacks are
        charged to the rows until an ack of it (:meth:`charging`)."""
        entry = self._entries.get(exchange)
        if entry is None or entry.state not in (DestinationState.OUTAGE, DestinationState.PROBING):
            return False
        if now - entry.since < self.max_wait:
            return False
        self._ended[exchange] = _Ended(now, entry.since, entry.failures)
        self._entries[exchange] = _Entry(
            DestinationState.OK, now + self._ok_ttl, reason=entry.reason, charging=True
        )
        return True

    def charging(self, exchange: str) -> bool:
        """Past an outage's bound, no ack since: every nack of it is the rows' fault."""
        entry = self._entries.get(exchange)
        return entry is not None and entry.charging

    def outage_age(self, exchange: str, now: float) -> float:
        """Seconds since the exchange's outage began (0 when none)."""
        entry = self._entries.get(exchange)
        if entry is None or entry.state not in (DestinationState.OUTAGE, DestinationState.PROBING):
            return 0.0
        return now - entry.since

    def left(self, exchange: str, now: float) -> float:
        """Seconds left of an outage's pause (0 when none)."""
        entry = self._entries.get(exchange)
        return max(0.0, entry.until - now) if entry is not None else 0.0

    def probe(self, exchange: str) -> int | None:
        entry = self._entries.get(exchange)
        return entry.probe if entry is not None else None

    def probing(self, exchange: str, row_id: int | None, now: float) -> None:
        """``row_id`` goes out as the outage's probe (None: the probe was lost, pick another)."""
        entry = self._entries.get(exchange)
        if entry is not None:
            entry.state, entry.probe = DestinationState.PROBING, row_id
            entry.until = min(entry.until, now)

    def probe_lost(self, ids: Collection[int]) -> list[str]:
        """Rows gone without an answer: the exchanges whose probe was among them."""
        out = []
        for name, entry in self._entries.items():
            if entry.probe is not None and entry.probe in ids:
                entry.probe = None
                out.append(name)
        return out

    def recovered(self, exchange: str, now: float) -> float | None:
        """A publish to ``exchange`` was confirmed: an outage ends. Returns how long it
        lasted (None: there was no outage)."""
        entry = self._entries.get(exchange)
        if entry is not None and entry.charging:  # an ack: its nacks are judged by the rule again
            self._entries[exchange] = _Entry(DestinationState.OK, now + self._ok_ttl)
            return None
        if entry is None or entry.state not in (DestinationState.OUTAGE, DestinationState.PROBING):
            return None
        self._ended[exchange] = _Ended(now, entry.since, entry.failures)
        self._entries[exchange] = _Entry(DestinationState.OK, now + self._ok_ttl)
        return now - entry.since

    def outages(self) -> list[str]:
        return [
            n
            for n, e in self._entries.items()
            if e.state in (DestinationState.OUTAGE, DestinationState.PROBING)
        ]
