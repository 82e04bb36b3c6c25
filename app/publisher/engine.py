"""The publisher service loop: claim, publish in a window, settle through the ledger, write back.

Tasks on one event loop, all DB calls on one worker thread (the repository is sync):

- **supervisor**: connects (backoff with jitter), opens ``settings.channels`` confirm channels,
  waits for the connection to die, starts over.
- **claimer**: keeps the window full: claims ``claim_batch`` due rows while fewer than
  ``window`` rows are held (claimed and not yet settled in the DB).
- **sender**: turns queued rows into publishes, one ``transport.write`` per batch and channel,
  registers them in the channel's :class:`~app.confirms.ChannelLedger`.
- **flusher**: every ``flush_interval`` writes the accumulated outcomes in one transaction
  (:meth:`~app.outbox.repository.OutboxRepository.unit_of_work`: one commit per flush), one
  repository call per outcome kind; a confirmed row gets its channel, delivery tag and publish
  time in the same statement that confirms it.
- **housekeeping**: heartbeat and lease renewal, ``release_expired`` for crashed publishers,
  the confirm timeout, and ``until_empty``.

Broker frames arrive as synchronous callbacks (:class:`_Link`), go through the ledger and land in
an :class:`_Outcomes` buffer; no future and no DB round trip per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, TypeAlias, TypeVar

from app.amqp import (
    AMQPConnection,
    CloseReason,
    OutgoingMessage,
    ReturnedMessage,
    WireError,
)
from app.confirms import (
    ChannelLedger,
    Confirmed,
    Event,
    LocalProtocolError,
    Lost,
    Nacked,
    RemoteProtocolError,
    Returned,
)
from app.outbox.repository import Backoff, ClaimedRow, OutboxRepository, Published, ReturnedRow
from app.outbox.states import Status
from app.publisher.destinations import Destinations, DestinationState
from app.publisher.envelope import CloseCause, CloseKind, EnvelopeError, classify_close, to_message
from app.publisher.metrics import PublisherMetrics, PublisherStats
from app.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")
#: Where and when a row went out: (channel id, delivery tag, wall-clock publish time).
SentFacts: TypeAlias = tuple[int, int, dt.datetime]
_Facts: TypeAlias = list[tuple[int, SentFacts | None]]

#: A row in this many unexplained channel closes goes to retry-with-budget instead of release,
#: so a message the broker always rejects cannot loop forever.
POISON_STRIKES = 3
MAX_STRIKE_ROWS = 100_000
ORPHAN_ERROR = "claimed by a claim whose result was lost: released unpublished"
EXCHANGE_OK_TTL = 60.0
#: Publishes still unconfirmed after this many seconds get their channel and delivery tag written
#: to their row (what the API shows as outstanding confirms); faster ones skip that write.
TAG_RECORD_DELAY = 0.5
RECONNECT_FIRST_DELAY = 0.1
STABLE_CONNECTION = 5.0  # a connection that lived longer reconnects at once when lost
SETUP_TIMEOUT = 10.0


def default_publisher_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


# ---------------------------------------------------------------- state


@dataclass(slots=True, eq=False)
class _Channel:
    """A confirm-mode channel of the current connection and its ledger."""

    id: int
    ledger: ChannelLedger
    runs: deque[tuple[int, float]] = field(default_factory=deque)  # (last tag, at) per write


@dataclass(frozen=True, slots=True)
class _Batch:
    """One publish write: rows ``ids`` got the contiguous tags from ``first_tag`` on ``channel``."""

    at: float
    channel: _Channel
    first_tag: int
    ids: list[int]
    wall: dt.datetime


@dataclass(slots=True)
class _Outcomes:
    """Settled outcomes waiting for the next flush."""

    #: late tag notes: (channel id, publish time) -> [(row id, delivery tag)]
    published: dict[tuple[int, dt.datetime], list[tuple[int, int]]] = field(default_factory=dict)
    confirmed: list[int] = field(default_factory=list)
    returned: list[ReturnedRow] = field(default_factory=list)
    nacked: list[int] = field(default_factory=list)
    lost: dict[str, list[int]] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)
    failed: dict[str, list[int]] = field(default_factory=dict)
    destination: dict[str, list[int]] = field(default_factory=dict)
    poison: dict[str, list[int]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.published or self.confirmed or self.returned or self.nacked
                    or self.lost or self.released or self.failed or self.destination
                    or self.poison)  # fmt: skip

    def settled_ids(self) -> Iterable[int]:
        yield from self.confirmed
        yield from (r.id for r in self.returned)
        yield from self.nacked
        yield from self.released
        for group in (self.lost, self.failed, self.destination, self.poison):
            for ids in group.values():
                yield from ids

    def merge(self, older: _Outcomes) -> None:
        """Put a failed flush's outcomes back in front of the newer ones."""
        for batch, tags in older.published.items():
            self.published[batch] = tags + self.published.get(batch, [])
        self.confirmed[:0] = older.confirmed
        self.returned[:0] = older.returned
        self.nacked[:0] = older.nacked
        self.released[:0] = older.released
        for mine, theirs in ((self.lost, older.lost), (self.failed, older.failed),
                             (self.destination, older.destination),
                             (self.poison, older.poison)):  # fmt: skip
            for key, ids in theirs.items():
                mine[key] = ids + mine.get(key, [])


@dataclass(frozen=True, slots=True)
class _Written:
    """What one flush moved in the DB (counts the repository returned)."""

    expected: int
    moved: int
    confirmed: int
    returned: int
    retried: int
    nacked_final: int
    failed: int
    lost: int
    released: int


def _add(group: dict[str, list[int]], key: str, ids: Iterable[int]) -> None:
    group.setdefault(key, []).extend(ids)


class _Link:
    """The wire listener of one connection; frames of a replaced connection are dropped."""

    __slots__ = ("_generation", "_publisher")

    def __init__(self, publisher: Publisher, generation: int) -> None:
        self._publisher = publisher
        self._generation = generation

    def _current(self) -> bool:
        return self._publisher._generation == self._generation

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        if self._current():
            self._publisher._on_settle(channel_id, delivery_tag, multiple, nack=False)

    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        if self._current():
            self._publisher._on_settle(channel_id, delivery_tag, multiple, nack=True)

    def on_return(self, channel_id: int, message: ReturnedMessage) -> None:
        if self._current():
            self._publisher._on_return(channel_id, message)

    def on_channel_closed(self, channel_id: int, reason: CloseReason) -> None:
        if self._current():
            self._publisher._on_channel_closed(channel_id, reason)

    def on_blocked(self, reason: str) -> None:
        if self._current():
            self._publisher._on_blocked(reason)

    def on_unblocked(self) -> None:
        if self._current():
            self._publisher._on_unblocked()

    def on_connection_lost(self, reason: CloseReason) -> None:
        if self._current():
            self._publisher._on_connection_lost(reason)


# ---------------------------------------------------------------- the publisher


class Publisher:
    """Drains the outbox into RabbitMQ with publisher confirms. One instance runs once."""

    def __init__(
        self,
        *,
        settings: Settings,
        repository: OutboxRepository,
        publisher_id: str | None = None,
        metrics: PublisherMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._repo = repository
        self.publisher_id = publisher_id or settings.publisher_id or default_publisher_id()
        self.metrics = metrics or PublisherMetrics()
        self._clock = clock
        self._backoff = Backoff(base=settings.backoff_base, cap=settings.backoff_max)
        self._destinations = Destinations(backoff=self._backoff, ok_ttl=EXCHANGE_OK_TTL)
        self._max_body = settings.max_body_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._conn: AMQPConnection | None = None
        self._generation = 0
        self._channels: dict[int, _Channel] = {}
        self._held: dict[int, ClaimedRow] = {}
        self._queue: deque[ClaimedRow] = deque()
        self._parked: dict[str, list[ClaimedRow]] = {}
        self._strikes: dict[int, int] = {}
        self._out = _Outcomes()
        self._blocked = False
        self._timeout_grace_until = 0.0
        self._stopping = False
        self._sending_stopped = False
        self._flushing_stopped = False
        self._stop = asyncio.Event()
        self._room = asyncio.Event()
        self._work = asyncio.Event()
        self._flush_wake = asyncio.Event()
        self._settled = asyncio.Event()
        self._aux: set[asyncio.Task[Any]] = set()
        self._reopening = False
        self._orphans_possible = False
        self._unrecorded: deque[_Batch] = deque()
        self._sent: dict[int, SentFacts] = {}  # held row -> its latest publish

    # ------------------------------------------------------------ run and stop

    def request_stop(self) -> None:
        """Begin a graceful stop (safe to call from a signal handler on the loop)."""
        self._stop.set()

    async def run(
        self, *, stop: asyncio.Event | None = None, until_empty: bool = False
    ) -> PublisherStats:
        """Publish until ``stop`` is set (or, with ``until_empty``, no open row remains)."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-db")
        try:
            await self._db(self._repo.register_publisher, publisher_id=self.publisher_id,
                           stale_after=3 * self._settings.publisher_heartbeat_interval)  # fmt: skip
            log.info("publisher %s started", self.publisher_id)
            await self._run_tasks(stop, until_empty)
            with contextlib.suppress(Exception):
                await self._db(self._repo.unregister_publisher, publisher_id=self.publisher_id,
                               stats=self.metrics.as_stats())  # fmt: skip
        finally:
            self._executor.shutdown(wait=True)
        stats = self.metrics.stats()
        log.info("publisher %s stopped: %s", self.publisher_id, stats)
        return stats

    async def _run_tasks(self, stop: asyncio.Event | None, until_empty: bool) -> None:
        main = {
            "supervisor": asyncio.create_task(self._supervise()),
            "claimer": asyncio.create_task(self._claim_loop()),
            "sender": asyncio.create_task(self._send_loop()),
            "flusher": asyncio.create_task(self._flush_loop()),
            "housekeeping": asyncio.create_task(self._housekeeping(until_empty)),
        }
        watchers = [asyncio.create_task(self._stop.wait())]
        if stop is not None:
            watchers.append(asyncio.create_task(stop.wait()))
        try:
            done, _ = await asyncio.wait([*main.values(), *watchers],
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        except asyncio.CancelledError:  # cancelled from outside: no graceful stop, no leftovers
            for task in [*main.values(), *watchers, *self._aux]:
                task.cancel()
            raise
        crashed = [t for t in done if t in main.values() and t.exception() is not None]
        for task in watchers:
            task.cancel()
        try:
            await self._shutdown(main)
        finally:
            for task in [*main.values(), *self._aux]:
                task.cancel()
        if crashed:
            raise crashed[0].exception()  # type: ignore[misc]

    async def _shutdown(self, tasks: dict[str, asyncio.Task[Any]]) -> None:
        """Stop claiming, release what was never published, settle the window, release the rest."""
        self._stopping = True
        self._stop.set()
        self._wake_all()
        await self._finish(tasks["claimer"])
        if self._orphans_possible:
            with contextlib.suppress(Exception):
                await self._release_orphans()
        for task in list(self._aux):
            task.cancel()
        await asyncio.gather(*self._aux, return_exceptions=True)
        self._sending_stopped = True
        self._work.set()
        await self._finish(tasks["sender"])
        self._release_unpublished()
        await self._settle_window(self._settings.shutdown_timeout)
        self._abandon_window("publisher stopped before the confirm came")
        conn = self._conn
        if conn is not None:
            await conn.close(timeout=min(5.0, self._settings.shutdown_timeout + 1))
        await self._finish(tasks["supervisor"])
        await self._finish(tasks["housekeeping"])
        self._flushing_stopped = True
        self._flush_wake.set()
        await self._finish(tasks["flusher"])
        for _ in range(3):
            if self._out.empty():
                break
            await self._flush()

    @staticmethod
    async def _finish(task: asyncio.Task[Any]) -> None:
        if task.done():
            if not task.cancelled() and task.exception() is not None:
                log.error("publisher task failed", exc_info=task.exception())
            return
        try:
            async with asyncio.timeout(30):
                await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
        except Exception:
            log.exception("publisher task failed")

    def _wake_all(self) -> None:
        for event in (self._room, self._work, self._flush_wake, self._settled):
            event.set()

    async def _sleep(self, seconds: float) -> None:
        """Sleep, cut short by a stop request."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    def _release_unpublished(self) -> None:
        rows = list(self._queue)
        self._queue.clear()
        for parked in self._parked.values():
            rows.extend(parked)
        self._parked.clear()
        self._out.released.extend(r.id for r in rows)
        self._flush_wake.set()

    async def _settle_window(self, timeout: float) -> None:
        deadline = self._clock() + timeout
        while self._outstanding() and self._conn is not None and self._conn.is_open:
            left = deadline - self._clock()
            if left <= 0:
                break
            self._settled.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.1)):
                    await self._settled.wait()

    def _abandon_window(self, reason: str) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        for ch in channels:
            self._apply(ch.ledger.channel_lost(reason=reason), self._lost_plain)

    def _outstanding(self) -> int:
        return sum(ch.ledger.outstanding for ch in self._channels.values())

    # ------------------------------------------------------------ DB thread

    async def _db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, **kwargs))

    # ------------------------------------------------------------ connection

    async def _supervise(self) -> None:
        """Connect, wait for the connection to die, reconnect; back off (with jitter) after a
        failed attempt or a connection that died young."""
        delay = RECONNECT_FIRST_DELAY
        first = True
        while not self._stopping:
            conn = await self._connect()
            if conn is not None:
                if not first:
                    self.metrics.reconnects += 1
                first = False
                opened = self._clock()
                reason = await conn.wait_closed()
                if self._stopping:
                    return
                log.warning("connection lost: %s; reconnecting", reason)
                if self._clock() - opened > STABLE_CONNECTION:
                    delay = RECONNECT_FIRST_DELAY
                    continue
            else:
                self.metrics.connect_failures += 1
            await self._sleep(delay * (0.5 + 0.5 * self._backoff.rng.random()))
            delay = min(delay * 2, self._settings.reconnect_max_delay)

    async def _connect(self) -> AMQPConnection | None:
        s = self._settings
        self._generation += 1
        link = _Link(self, self._generation)
        conn: AMQPConnection | None = None
        try:
            conn = await AMQPConnection.connect(
                s.amqp_url.get_secret_value(), listener=link, heartbeat=s.heartbeat,
                name=f"outbox-publisher {self.publisher_id}", timeout=SETUP_TIMEOUT,
            )  # fmt: skip
            async with asyncio.timeout(SETUP_TIMEOUT):
                channels = [await conn.open_channel() for _ in range(s.channels)]
        except (OSError, WireError, TimeoutError) as exc:
            log.warning("cannot connect to the broker: %s", exc)
            if conn is not None:
                conn.abort(reason="setup failed")
            return None
        self._conn = conn
        self._blocked = False
        self._channels = {cid: _Channel(cid, ChannelLedger(channel_id=cid)) for cid in channels}
        self.metrics.connected = True
        log.info("connected to the broker, channels %s", channels)
        self._wake_all()
        return conn

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    async def _reopen_channels(self) -> None:
        if self._reopening:
            return
        self._reopening = True
        try:
            conn = self._conn
            while self._wants_channel(conn):
                assert conn is not None
                cid = await conn.open_channel()
                if conn is self._conn and conn.is_open:
                    self._channels[cid] = _Channel(cid, ChannelLedger(channel_id=cid))
                    self._work.set()
        except (WireError, TimeoutError) as exc:
            log.warning("cannot reopen a channel: %s", exc)
        finally:
            self._reopening = False

    def _wants_channel(self, conn: AMQPConnection | None) -> bool:
        return (conn is not None and conn is self._conn and conn.is_open and not self._stopping
                and len(self._channels) < self._settings.channels)  # fmt: skip

    # ------------------------------------------------------------ broker callbacks (sync)

    def _on_settle(self, channel_id: int, tag: int, multiple: bool, *, nack: bool) -> None:
        ch = self._channels.get(channel_id)
        if ch is None:
            return
        try:
            events = ch.ledger.nack(tag, multiple=multiple) if nack else ch.ledger.ack(
                tag, multiple=multiple)  # fmt: skip
        except RemoteProtocolError as exc:
            self._protocol_error(ch, exc)
            return
        self._observe_latency(ch, tag, multiple)
        self._apply(events, self._lost_plain)
        if not self._outstanding():
            self._settled.set()

    def _observe_latency(self, ch: _Channel, tag: int, multiple: bool) -> None:
        runs = ch.runs
        now = self._clock()
        while runs and runs[0][0] <= tag:
            self.metrics.observe_confirm_latency(now - runs.popleft()[1])

    def _on_return(self, channel_id: int, message: ReturnedMessage) -> None:
        ch = self._channels.get(channel_id)
        if ch is None:
            return
        try:
            ch.ledger.returned(message_id=message.message_id or "", reply_code=message.reply_code,
                               reply_text=message.reply_text)  # fmt: skip
        except RemoteProtocolError as exc:
            self._protocol_error(ch, exc)

    def _protocol_error(self, ch: _Channel, exc: RemoteProtocolError) -> None:
        """The broker said something impossible on this channel: count it, and trust nothing
        more from the channel: its outstanding rows go back (as lost) and it is replaced."""
        self.metrics.protocol_errors += 1
        log.error("broker protocol error: %s; dropping channel %d", exc, ch.id)
        self._drop_channel(ch, f"protocol error: {exc}")
        conn = self._conn
        if conn is not None and conn.is_open:
            self._spawn(self._close_and_reopen(conn, ch.id))

    async def _close_and_reopen(self, conn: AMQPConnection, channel_id: int) -> None:
        await conn.close_channel(channel_id)
        await self._reopen_channels()

    def _drop_channel(self, ch: _Channel, reason: str) -> None:
        self._channels.pop(ch.id, None)
        self._apply(ch.ledger.channel_lost(reason=reason), self._lost_plain)
        self._settled.set()

    def _on_channel_closed(self, channel_id: int, reason: CloseReason) -> None:
        ch = self._channels.pop(channel_id, None)
        if ch is None:
            return
        self.metrics.channel_closes += 1
        log.warning("broker closed channel %d: %s", channel_id, reason)
        cause = classify_close(reason)
        why = f"channel {channel_id} closed: {reason}"
        events = ch.ledger.channel_lost(reason=why)
        self._apply(events, functools.partial(self._lost_by_cause, cause=cause))
        self._settled.set()
        if not self._stopping:
            self._spawn(self._reopen_channels())

    def _on_blocked(self, reason: str) -> None:
        log.warning("broker blocked publishing: %s", reason)
        self._blocked = True
        self.metrics.set_blocked(True, now=self._clock())

    def _on_unblocked(self) -> None:
        log.info("broker unblocked publishing")
        self._blocked = False
        self.metrics.set_blocked(False, now=self._clock())
        self._timeout_grace_until = self._clock() + self._settings.confirm_timeout
        self._wake_all()

    def _on_connection_lost(self, reason: CloseReason) -> None:
        self.metrics.connected = False
        if self._blocked:
            self._blocked = False
            self.metrics.set_blocked(False, now=self._clock())
        self._abandon_window(f"connection lost: {reason}")
        self._settled.set()
        self._room.set()

    # ------------------------------------------------------------ ledger events -> outcomes

    def _apply(self, events: list[Event], on_lost: Callable[[Lost], None]) -> None:
        out = self._out
        for event in events:
            if isinstance(event, Confirmed):
                out.confirmed.extend(event.row_ids)
            elif isinstance(event, Returned):
                out.returned.append(ReturnedRow(event.row_id, event.reply_code, event.reply_text))
            elif isinstance(event, Nacked):
                self.metrics.nacked += len(event.row_ids)
                out.nacked.extend(event.row_ids)
            elif isinstance(event, Lost):
                on_lost(event)
        if events:
            self._flush_wake.set()

    def _lost_plain(self, event: Lost) -> None:
        self.metrics.lost += len(event.row_ids)
        _add(self._out.lost, event.reason, event.row_ids)

    def _lost_by_cause(self, event: Lost, *, cause: CloseCause) -> None:
        if cause.kind is CloseKind.DESTINATION and cause.exchange is not None:
            self._lost_to_destination(event, cause.exchange)
        elif cause.kind is CloseKind.OVERSIZED and cause.max_size is not None:
            self._lost_to_size(event, cause.max_size)
        else:
            self._lost_unexplained(event)

    def _lost_to_destination(self, event: Lost, exchange: str) -> None:
        mine = [i for i in event.row_ids if self._exchange_of(i) == exchange]
        others = [i for i in event.row_ids if self._exchange_of(i) != exchange]
        self._destination_failed(exchange, event.reason, mine)
        if others:
            self._lost_plain(Lost(tuple(others), event.reason))

    def _destination_failed(self, exchange: str, reason: str, ids: Sequence[int]) -> None:
        delay = self._destinations.failed(exchange, reason, self._clock())
        self.metrics.destination_errors += 1
        log.warning("exchange %r unusable (%s): its rows back off %.1fs", exchange, reason, delay)
        if ids:
            _add(self._out.destination, f"exchange {exchange!r}: {reason}", ids)
            self._flush_wake.set()

    def _lost_to_size(self, event: Lost, max_size: int) -> None:
        self._max_body = min(self._max_body, max_size)
        big = [i for i in event.row_ids if self._body_size(i) > max_size]
        rest = [i for i in event.row_ids if self._body_size(i) <= max_size]
        if big:
            reason = f"body larger than the broker's max_message_size ({max_size} bytes)"
            _add(self._out.failed, reason, big)
        if rest:
            self._lost_plain(Lost(tuple(rest), event.reason))

    def _lost_unexplained(self, event: Lost) -> None:
        strikes = self._strikes
        poison: list[int] = []
        plain: list[int] = []
        for row_id in event.row_ids:
            strikes[row_id] = strikes.get(row_id, 0) + 1
            (poison if strikes[row_id] >= POISON_STRIKES else plain).append(row_id)
        if poison:
            _add(self._out.poison, f"in {POISON_STRIKES} channel closes: {event.reason}", poison)
        if plain:
            self._lost_plain(Lost(tuple(plain), event.reason))

    def _exchange_of(self, row_id: int) -> str | None:
        row = self._held.get(row_id)
        return row.exchange if row is not None else None

    def _body_size(self, row_id: int) -> int:
        row = self._held.get(row_id)
        return len(row.body) if row is not None else 0

    # ------------------------------------------------------------ claimer

    async def _claim_loop(self) -> None:
        s = self._settings
        threshold = max(1, min(s.claim_batch, s.window) // 2)
        while not self._stopping:
            room = s.window - len(self._held)
            if room < threshold or not self._can_publish():
                self._room.clear()
                await self._room.wait()
                continue
            limit = min(s.claim_batch, room)
            try:
                if self._orphans_possible:
                    await self._release_orphans()
                rows = await self._db(self._repo.claim, owner=self.publisher_id, limit=limit,
                                      lease_seconds=s.lease_seconds)  # fmt: skip
            except Exception:
                # The claim may have committed all the same (the COMMIT's reply lost): its rows
                # are leased to us but unknown here, and the heartbeat would renew them forever.
                self._orphans_possible = True
                self.metrics.db_errors += 1
                log.exception("claim failed")
                await self._sleep(max(s.poll_interval, 1.0))
                continue
            if rows:
                self._accept(rows)
            if not rows:  # idle: poll
                await self._sleep(s.poll_interval)
            elif len(rows) < limit:  # caught up: a short pause lets the next rows gather,
                await self._sleep(min(s.poll_interval, s.flush_interval))  # not a poll's wait

    async def _release_orphans(self) -> None:
        """Give back rows leased to this publisher that it does not hold (never published)."""
        released = await self._db(self._write_orphans, held=frozenset(self._held))
        self._orphans_possible = False
        if released:
            self.metrics.released += released
            log.warning("released %d rows a failed claim had leased to us unseen", released)

    def _write_orphans(self, *, held: frozenset[int]) -> int:
        """DB thread. Safe only between claims: every row a finished claim returned is in
        ``held`` (flushed rows have left ``in_flight`` before their ids leave ``held``)."""
        leased = self._repo.leased_ids(owner=self.publisher_id)
        orphans = [row_id for row_id in leased if row_id not in held]
        if not orphans:
            return 0
        return self._repo.release(owner=self.publisher_id, ids=orphans, lost=False,
                                  error=ORPHAN_ERROR)  # fmt: skip

    def _accept(self, rows: list[ClaimedRow]) -> None:
        self.metrics.claims += 1
        self.metrics.claimed += len(rows)
        held = self._held
        for row in rows:
            held[row.id] = row
        self._queue.extend(rows)
        self.metrics.held = len(held)
        self._work.set()

    def _can_publish(self) -> bool:
        conn = self._conn
        return conn is not None and conn.is_open and not self._blocked and not self._stopping

    # ------------------------------------------------------------ sender

    async def _send_loop(self) -> None:
        batch = max(1, self._settings.claim_batch)
        while not self._sending_stopped:
            if not self._queue or not self._can_publish() or not self._channels:
                self._work.clear()
                await self._work.wait()
                continue
            rows = [self._queue.popleft() for _ in range(min(batch, len(self._queue)))]
            self._route(rows)
            conn = self._conn
            if conn is not None and conn.write_paused:
                await conn.drain()
            else:
                await asyncio.sleep(0)

    def _route(self, rows: list[ClaimedRow]) -> None:
        """Publish what can go now; fail oversized rows; park or back off per destination."""
        now = self._clock()
        ready: list[ClaimedRow] = []
        dest = self._destinations
        for row in rows:
            if len(row.body) > self._max_body:
                reason = f"body larger than the limit of {self._max_body} bytes"
                _add(self._out.failed, reason, [row.id])
                continue
            state = dest.state(row.exchange, now)
            if state is DestinationState.OK:
                ready.append(row)
            elif state is DestinationState.PAUSED:
                reason = f"exchange {row.exchange!r} backing off: {dest.reason(row.exchange)}"
                _add(self._out.destination, reason, [row.id])
            else:
                self._park(row, start_check=state is DestinationState.UNKNOWN)
        if len(ready) < len(rows):
            self._flush_wake.set()
        if ready:
            self._send(ready, now)

    def _park(self, row: ClaimedRow, *, start_check: bool) -> None:
        self._parked.setdefault(row.exchange, []).append(row)
        conn = self._conn
        if start_check and conn is not None:
            self._destinations.checking(row.exchange)
            self._spawn(self._check_exchange(conn, row.exchange))

    async def _check_exchange(self, conn: AMQPConnection, exchange: str) -> None:
        try:
            reason = await conn.exchange_exists(exchange)
        except ValueError:  # not even a valid exchange name: publishing fails each row for good
            reason = None
        except (WireError, TimeoutError, OSError) as exc:
            log.info("exchange check of %r did not finish: %s", exchange, exc)
            self._destinations.unchecked(exchange)
            self._unpark(exchange)
            return
        if reason is None:
            self._destinations.ok(exchange, self._clock())
            self._unpark(exchange)
            return
        rows = self._parked.pop(exchange, [])
        self._destination_failed(exchange, str(reason), [r.id for r in rows])

    def _unpark(self, exchange: str) -> None:
        rows = self._parked.pop(exchange, [])
        self._queue.extendleft(reversed(rows))
        self._work.set()

    def _send(self, rows: list[ClaimedRow], now: float) -> None:
        conn, ch = self._conn, self._pick_channel()
        if conn is None or ch is None or not conn.channel_is_open(ch.id):
            self._queue.extendleft(reversed(rows))
            return
        messages: list[OutgoingMessage] = []
        good: list[ClaimedRow] = []
        for row in rows:
            try:
                messages.append(to_message(row))
                good.append(row)
            except EnvelopeError as exc:
                _add(self._out.failed, str(exc), [row.id])
        data, errors = conn.encode_batch(ch.id, messages)
        if errors:
            bad = dict(errors)
            for index, error in bad.items():
                _add(self._out.failed, f"cannot encode the message: {error}", [good[index].id])
            good = [row for index, row in enumerate(good) if index not in bad]
            self._flush_wake.set()
        if not good:
            return
        try:
            tags = ch.ledger.published_many([(r.id, r.message_id) for r in good], at=now)
        except LocalProtocolError:
            log.exception("ledger refused a batch; releasing it unpublished")
            self._out.released.extend(r.id for r in good)
            return
        conn.write_batch(ch.id, data)
        ch.runs.append((tags[-1], now))
        ids = [r.id for r in good]
        wall = self._repo.clock()
        self._unrecorded.append(_Batch(now, ch, tags.start, ids, wall))
        self._sent.update(zip(ids, zip(repeat(ch.id), tags, repeat(wall)), strict=True))
        self.metrics.published += len(good)

    def _pick_channel(self) -> _Channel | None:
        channels = self._channels
        if not channels:
            return None
        if len(channels) == 1:
            return next(iter(channels.values()))
        return min(channels.values(), key=lambda ch: ch.ledger.outstanding)

    # ------------------------------------------------------------ flusher

    async def _flush_loop(self) -> None:
        interval = self._settings.flush_interval
        while True:
            self._note_tags(self._clock())
            if self._out.empty():
                if self._flushing_stopped:
                    return
                self._flush_wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._next_tags_due()):
                        await self._flush_wake.wait()
                continue
            await asyncio.sleep(interval)
            await self._flush()

    def _note_tags(self, now: float) -> None:
        """Queue the tags of publishes unconfirmed for TAG_RECORD_DELAY for the next flush.

        A publish confirmed sooner (nearly all of them) never costs a tag write; one that waits
        longer shows up with its channel and delivery tag among the outstanding confirms.
        """
        pending = self._unrecorded
        published = self._out.published
        while pending and pending[0].at <= now - TAG_RECORD_DELAY:
            batch = pending.popleft()
            ledger = batch.channel.ledger
            if ledger.closed:
                continue
            still = [(row, tag) for tag, row in enumerate(batch.ids, batch.first_tag)
                     if ledger.row_for_tag(tag) == row]  # fmt: skip
            if still:
                published.setdefault((batch.channel.id, batch.wall), []).extend(still)

    def _next_tags_due(self) -> float | None:
        if not self._unrecorded:
            return None
        return max(0.0, self._unrecorded[0].at + TAG_RECORD_DELAY - self._clock())

    async def _flush(self) -> None:
        self._note_tags(self._clock())
        out, self._out = self._out, _Outcomes()
        sent = self._sent
        facts = [(row_id, sent.get(row_id)) for row_id in out.confirmed]
        returned = [(r.id, sent.get(r.id)) for r in out.returned]
        try:
            written = await self._db(self._write, out=out, facts=facts, returned=returned)
        except Exception:
            self.metrics.db_errors += 1
            log.exception("writing outcomes failed; retrying")
            self._out.merge(out)
            await self._sleep(1.0)
            return
        self._count(written)
        self._forget(out)
        self.metrics.held = len(self._held)
        self.metrics.outstanding = self._outstanding()
        self._room.set()

    def _forget(self, out: _Outcomes) -> None:
        """Drop the rows this flush settled. Runs before any later claim's rows are accepted:
        claims and flushes share the one DB thread, so their results reach the loop in order."""
        held, sent = self._held, self._sent
        for row_id in out.settled_ids():
            held.pop(row_id, None)
            sent.pop(row_id, None)
        self._forget_strikes(out)

    def _forget_strikes(self, out: _Outcomes) -> None:
        """Rows that may come back after an unexplained channel close (lost, poison) keep their
        strikes, so a message that always breaks its channel reaches POISON_STRIKES."""
        strikes = self._strikes
        if not strikes:
            return
        if len(strikes) > MAX_STRIKE_ROWS:  # rows other publishers took over never come back
            strikes.clear()
            return
        keep = {i for group in (out.lost, out.poison) for ids in group.values() for i in ids}
        for row_id in out.settled_ids():
            if row_id not in keep:
                strikes.pop(row_id, None)

    def _count(self, w: _Written) -> None:
        m = self.metrics
        m.flushes += 1
        m.confirmed += w.confirmed
        m.returned += w.returned
        m.retried += w.retried
        m.failed += w.failed + w.nacked_final
        m.released += w.released
        if w.moved < w.expected:
            m.lease_lost += w.expected - w.moved
            log.warning("%d rows were no longer held by this publisher (lease lost)",
                        w.expected - w.moved)  # fmt: skip

    def _write(self, *, out: _Outcomes, facts: _Facts, returned: _Facts) -> _Written:
        """Runs on the DB thread: the whole flush in one transaction (one commit), so a failure
        anywhere rolls all of it back and the caller retries the same outcomes.

        ``facts``/``returned``: the publish facts of the confirmed/returned rows, in their order.
        """
        with self._repo.unit_of_work():
            return self._write_all(out, facts, returned)

    def _write_all(self, out: _Outcomes, facts: _Facts, returned_facts: _Facts) -> _Written:
        """One repository call per outcome kind (and reason)."""
        repo, owner = self._repo, self.publisher_id
        settled = set(out.settled_ids())
        for (channel_id, at), tags in out.published.items():
            still_out = [pair for pair in tags if pair[0] not in settled]
            if still_out:
                repo.record_published(owner=owner, channel_id=channel_id, tags=still_out,
                                      published_at=at)  # fmt: skip
        confirmed = self._confirm(facts) if facts else 0
        returned = repo.mark_returned(
            owner=owner, returns=out.returned,
            published=[Published(row_id, *f) for row_id, f in returned_facts if f is not None],
        ) if out.returned else 0  # fmt: skip
        retried = final = failed = lost = released = 0
        if out.nacked:
            r = repo.retry(owner=owner, ids=out.nacked, error="nacked by the broker",
                           backoff=self._backoff, exhausted=Status.NACKED)  # fmt: skip
            retried, final = r.retried, r.exhausted
        for reason, ids in out.destination.items():
            r = repo.retry(owner=owner, ids=ids, error=reason, backoff=self._backoff,
                           exhausted=Status.FAILED,
                           max_attempts=self._settings.destination_retry_budget)  # fmt: skip
            retried, failed = retried + r.retried, failed + r.exhausted
        for reason, ids in out.poison.items():
            r = repo.retry(owner=owner, ids=ids, error=reason, backoff=self._backoff,
                           exhausted=Status.FAILED)  # fmt: skip
            retried, failed = retried + r.retried, failed + r.exhausted
        for reason, ids in out.failed.items():
            failed += repo.mark_failed(owner=owner, ids=ids, reason=reason)
        for reason, ids in out.lost.items():
            lost += repo.release(owner=owner, ids=ids, lost=True, error=reason)
        if out.released:
            released = repo.release(owner=owner, ids=out.released, lost=False)
        expected = len(settled)
        moved = confirmed + returned + retried + final + failed + lost + released
        return _Written(expected, moved, confirmed, returned, retried, final, failed, lost,
                        released)  # fmt: skip

    def _confirm(self, facts: _Facts) -> int:
        published = [Published(row_id, *f) for row_id, f in facts if f is not None]
        bare = [row_id for row_id, f in facts if f is None]
        return self._repo.mark_confirmed(owner=self.publisher_id, ids=bare, published=published)

    # ------------------------------------------------------------ housekeeping

    async def _housekeeping(self, until_empty: bool) -> None:
        s = self._settings
        next_beat = next_sweep = 0.0
        while not self._stopping:
            now = self._clock()
            try:
                if now >= next_beat:
                    self.metrics.outstanding = self._outstanding()
                    # renew only the rows we hold: one leased to us unseen (a claim whose
                    # reply was lost) must expire and come back, not be renewed forever
                    await self._db(self._repo.heartbeat, publisher_id=self.publisher_id,
                                   lease_seconds=s.lease_seconds, held=list(self._held),
                                   stats=self.metrics.as_stats(now=now))  # fmt: skip
                    next_beat = now + min(s.publisher_heartbeat_interval, s.lease_seconds / 3)
                if now >= next_sweep:
                    swept = await self._db(self._repo.release_expired)
                    if swept:
                        log.warning("released %d rows of expired leases", swept)
                    next_sweep = now + s.lease_seconds / 2
                if until_empty and await self._drained():
                    log.info("outbox drained: stopping")
                    self.request_stop()
                    return
            except Exception:
                self.metrics.db_errors += 1
                log.exception("housekeeping failed")
            self._check_confirm_timeout(self._clock())
            await self._sleep(min(1.0, s.poll_interval))

    async def _drained(self) -> bool:
        if self._held or self._queue or not self._out.empty():
            return False
        return await self._db(self._repo.count_open) == 0

    def _check_confirm_timeout(self, now: float) -> None:
        conn = self._conn
        if conn is None or not conn.is_open or self._blocked or now < self._timeout_grace_until:
            return
        oldest = [at for ch in self._channels.values()
                  if (at := ch.ledger.oldest_outstanding_at()) is not None]  # fmt: skip
        if oldest and now - min(oldest) > self._settings.confirm_timeout:
            log.error("no confirm for %.1fs: dropping the connection", now - min(oldest))
            conn.abort(reason=f"confirm timeout ({self._settings.confirm_timeout}s)")
