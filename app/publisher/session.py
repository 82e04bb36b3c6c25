"""The broker side of one publisher: one connection at a time, its confirm channels and their
ledgers, and the broker's callbacks turned into ledger events for the engine.

- :meth:`Session.run` connects (backoff with jitter; an outage logged once when it begins, a
  reminder a minute, and its length when it ends: :mod:`app.publisher.unreachable`), opens
  ``min(channels, what the broker's channel_max allows)`` confirm channels, waits for the
  connection to die and starts over. A connection the broker closed for a frame or content error
  reconnects at once: the quarantine, not a backoff, makes progress against a bad row.
- Broker callbacks arrive synchronously (:class:`_Link`), go through the channel's
  :class:`~app.confirms.ChannelLedger`, and reach the engine through :class:`SessionEvents`.
- ``checking_on_channel``: the sender runs an exchange check on a publishing channel
  (``channel_max`` 1), publishing paused meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.amqp.codec import OutgoingMessage, ReturnedMessage
from app.amqp.connection import AMQPConnection
from app.amqp.errors import CloseReason, WireError
from app.confirms import (
    ChannelLedger,
    Event,
    LocalProtocolError,
    Lost,
    RemoteProtocolError,
    TagNoteMap,
)
from app.logs import redact_url
from app.outbox.records import ClaimedRow
from app.publisher.metrics import PublisherMetrics
from app.publisher.settlement import (
    PLAIN,
    CloseCause,
    CloseKind,
    classify_channel_close,
    classify_connection_loss,
)
from app.publisher.unreachable import BrokerOutage
from app.settings import Settings

log = logging.getLogger("app.publisher")

RECONNECT_FIRST_DELAY = 0.1
STABLE_CONNECTION = 5.0  # a connection that lived longer reconnects at once when lost
SETUP_TIMEOUT = 10.0
STOP_CLOSE_TIMEOUT = 5.0
#: After a confirm timeout, at most this many publishes are outstanding until the broker answers
#: one: a quorum queue without a leader (or any broker that takes publishes and never confirms)
#: would otherwise get the whole window again on every new connection, each one published into
#: the void, counted as a possible duplicate and published again five seconds later.
CAUTIOUS_WINDOW = 20


@dataclass(slots=True, eq=False)
class Channel:
    """A confirm-mode channel of the current connection and its ledger."""

    id: int
    ledger: ChannelLedger


@dataclass(frozen=True, slots=True)
class SendResult:
    """What one write put on the wire: ``rows`` got the contiguous ``tags`` on ``channel``;
    ``refused`` could not be encoded (never sent, no tag)."""

    channel: Channel
    rows: list[ClaimedRow]
    tags: range
    refused: list[tuple[ClaimedRow, Exception]]


class SessionEvents(Protocol):
    """What the engine hears from the session (all called on the event loop)."""

    def answered(self, events: list[Event]) -> None: ...

    def lost(self, events: list[Event], cause: CloseCause) -> None: ...

    def connection_changed(self) -> None: ...

    def blocked_changed(self) -> None: ...


class _Unattached:
    """A session's listener until :meth:`Session.attach`: an event then is a wiring bug."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"session event {name!r} before Session.attach()")


class _Link:
    """The wire listener of one connection; frames of a replaced connection are dropped."""

    __slots__ = ("_generation", "_session")

    def __init__(self, session: Session, generation: int) -> None:
        self._session = session
        self._generation = generation

    def _current(self) -> bool:
        return self._session.generation == self._generation

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        if self._current():
            self._session._settle(channel_id, delivery_tag, multiple, nack=False)

    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        if self._current():
            self._session._settle(channel_id, delivery_tag, multiple, nack=True)

    def on_return(self, channel_id: int, message: ReturnedMessage) -> None:
        if self._current():
            self._session._returned(channel_id, message)

    def on_channel_closed(self, channel_id: int, reason: CloseReason) -> None:
        if self._current():
            self._session._channel_closed(channel_id, reason)

    def on_blocked(self, reason: str) -> None:
        if self._current():
            self._session._blocked(True, reason)

    def on_unblocked(self) -> None:
        if self._current():
            self._session._blocked(False, None)

    def on_connection_lost(self, reason: CloseReason) -> None:
        if self._current():
            self._session._connection_lost(reason)


class Session:
    """One broker connection at a time and its confirm channels."""

    def __init__(
        self,
        *,
        settings: Settings,
        metrics: PublisherMetrics,
        name: str,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._events: SessionEvents = _Unattached()
        self._name = name
        self._clock = clock
        self._rng = rng
        self.conn: AMQPConnection | None = None
        #: when the current connection was opened (monotonic): returns soon after are retried
        self.connected_at: float | None = None
        self.generation = 0
        self.channels: dict[int, Channel] = {}
        self.blocked = False
        self.blocked_reason: str | None = None
        self.checking_on_channel = False  # a passive declare runs on a publishing channel
        self.stopping = False
        self._reopening = False
        self._last_cause: CloseCause = PLAIN
        #: the broker the last connection was to: tried after the others on the next connect
        self._left: tuple[str, int] | None = None
        self._unblocked_at = 0.0
        #: since when confirms stopped, while the publisher waits for an answer after a confirm
        #: timeout (at most CAUTIOUS_WINDOW outstanding meanwhile); None when answers come
        self.cautious_since: float | None = None
        self._timeouts_in_row = 0
        self._aux: set[asyncio.Task[Any]] = set()
        self._warned_channel_max = False
        self.outage = BrokerOutage(clock=clock)
        self._connect_error: object = None

    def attach(self, events: SessionEvents) -> None:
        """Where the session's events go (the publisher's answers part)."""
        self._events = events

    # ------------------------------------------------------------ state

    def can_publish(self) -> bool:
        conn = self.conn
        return (
            conn is not None
            and conn.is_open
            and not self.blocked
            and not self.stopping
            and not self.checking_on_channel
            and bool(self.channels)
            and (self.cautious_since is None or self.outstanding() < CAUTIOUS_WINDOW)
        )

    def publish_room(self, batch: int) -> int:
        """How many rows the next publish may take: ``batch``, or after a confirm timeout what
        is left of CAUTIOUS_WINDOW until the broker answers again."""
        if self.cautious_since is None:
            return batch
        return max(0, min(batch, CAUTIOUS_WINDOW - self.outstanding()))

    @property
    def connected(self) -> bool:
        return self.conn is not None and self.conn.is_open

    def connection_age(self) -> float:
        """Seconds since the current connection opened (infinite when none is open)."""
        if self.connected_at is None:
            return float("inf")
        return self._clock() - self.connected_at

    def outstanding(self) -> int:
        return sum(ch.ledger.outstanding for ch in self.channels.values())

    def oldest_outstanding_at(self) -> float | None:
        oldest = [
            at
            for ch in self.channels.values()
            if (at := ch.ledger.oldest_outstanding_at()) is not None
        ]
        return min(oldest, default=None)

    def due_notes(self, cutoff: float, into: TagNoteMap) -> int:
        """Publishes written at or before ``cutoff`` and still unconfirmed, on every channel,
        each reported once (:meth:`~app.confirms.ChannelLedger.due_notes`)."""
        return sum(ch.ledger.due_notes(cutoff, into) for ch in self.channels.values())

    def next_note_at(self) -> float | None:
        """The write time of the oldest publish no note has looked at yet, on any channel."""
        times = [
            at for ch in self.channels.values() if (at := ch.ledger.next_note_at()) is not None
        ]
        return min(times, default=None)

    # ------------------------------------------------------------ connecting

    async def run(self) -> None:
        """Connect, wait for the connection to die, reconnect, until :attr:`stopping`."""
        delay = RECONNECT_FIRST_DELAY
        first = True
        while not self.stopping:
            conn = await self._connect()
            if conn is not None and self.stopping:
                # the stop came while this connection was being set up: close() has already run
                # and saw the old one (or none), so this one would wait for a close forever
                with contextlib.suppress(Exception):
                    await conn.close(timeout=STOP_CLOSE_TIMEOUT)
                return
            if conn is None:
                self._metrics.connect_failures += 1
            else:
                self.outage.connected()
                if not first:
                    self._metrics.reconnects += 1
                first = False
                opened = self._clock()
                reason = await conn.wait_closed()
                self.outage.disconnected()
                self._left = conn.address
                if self.stopping:
                    return
                log.warning("broker connection lost: %s; reconnecting", reason)
                lived = self._clock() - opened
                if lived > STABLE_CONNECTION or self._last_cause.kind is CloseKind.UNEXPLAINED:
                    delay = RECONNECT_FIRST_DELAY
                    continue
            wait = delay * (0.5 + 0.5 * self._rng.random())
            if conn is None:
                url = redact_url(self._settings.amqp_url.get_secret_value())
                self.outage.failed(broker=url, error=self._connect_error, retry_in=wait)
            await self._sleep(wait)
            delay = min(delay * 2, self._settings.reconnect_max_delay)

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _connect(self) -> AMQPConnection | None:
        s = self._settings
        self.generation += 1
        link = _Link(self, self.generation)
        conn: AMQPConnection | None = None
        url = s.amqp_url.get_secret_value()
        try:
            conn = await AMQPConnection.connect(
                url,
                listener=link,
                heartbeat=s.heartbeat,
                name=self._name,
                timeout=SETUP_TIMEOUT,
                shuffle=self._rng,
                try_last=self._left,
            )
            async with asyncio.timeout(SETUP_TIMEOUT):
                ids = [await conn.open_channel() for _ in range(self._channel_count(conn))]
        except (OSError, WireError, TimeoutError) as exc:
            self._connect_error = str(exc) or type(exc).__name__
            if conn is not None:
                conn.abort(reason="setup failed")
            return None
        self.conn = conn
        self.connected_at = self._clock()
        self.blocked, self.blocked_reason = False, None
        self._last_cause = PLAIN
        self.channels = {cid: Channel(cid, ChannelLedger(channel_id=cid)) for cid in ids}
        self._metrics.connected = True
        node = f"{conn.address[0]}:{conn.address[1]}" if conn.address else "?"
        log.info(
            "connected to the broker at %s (node %s, frame_max %d, channel_max %d), channels %s",
            redact_url(url),
            node,
            conn.frame_max,
            conn.channel_max,
            ids,
        )
        self._metrics.broker_node = node
        self._events.connection_changed()
        return conn

    def _channel_count(self, conn: AMQPConnection) -> int:
        """``OUTBOX_CHANNELS``, within what the broker allows (leaving one for exchange checks
        when it allows more)."""
        want = self._settings.channels
        allowed = conn.channel_max
        usable = want if want < allowed else allowed
        if usable < want and not self._warned_channel_max:
            self._warned_channel_max = True
            log.warning(
                "the broker allows %d channel(s) per connection: publishing on %d, not "
                "OUTBOX_CHANNELS=%d",
                allowed,
                usable,
                want,
            )
        return max(1, usable)

    # ------------------------------------------------------------ publishing

    def pick_channel(self) -> Channel | None:
        channels = self.channels
        if not channels:
            return None
        if len(channels) == 1:
            return next(iter(channels.values()))
        return min(channels.values(), key=lambda ch: ch.ledger.outstanding)

    def send(
        self,
        rows: list[ClaimedRow],
        messages: list[OutgoingMessage],
        *,
        at: float,
        wall: dt.datetime | None = None,
    ) -> SendResult | None:
        """Encode ``messages`` (one per row) into one buffer and write it on one channel; None
        when no channel can take it now (nothing was registered or sent)."""
        conn, ch = self.conn, self.pick_channel()
        if conn is None or ch is None or not conn.is_open or not conn.channel_is_open(ch.id):
            return None
        data, errors = conn.encode_batch(ch.id, messages)
        refused: list[tuple[ClaimedRow, Exception]] = []
        good = rows
        if errors:
            bad = dict(errors)
            refused = [(rows[i], exc) for i, exc in bad.items()]
            good = [row for i, row in enumerate(rows) if i not in bad]
        if not good:
            return SendResult(ch, [], range(0), refused)
        try:
            tags = ch.ledger.published_many([(r.id, r.message_id) for r in good], at=at, wall=wall)
        except LocalProtocolError:
            log.exception("the confirm ledger refused a batch; it goes back unpublished")
            return None
        conn.write_batch(ch.id, data)
        return SendResult(ch, good, tags, refused)

    @property
    def write_paused(self) -> bool:
        return self.conn is not None and self.conn.write_paused

    async def drain(self) -> None:
        if self.conn is not None:
            await self.conn.drain()

    # ------------------------------------------------------------ broker callbacks (sync)

    def _settle(self, channel_id: int, tag: int, multiple: bool, *, nack: bool) -> None:
        ch = self.channels.get(channel_id)
        if ch is None:
            return
        try:
            events = (
                ch.ledger.nack(tag, multiple=multiple)
                if nack
                else ch.ledger.ack(tag, multiple=multiple)
            )
        except RemoteProtocolError as exc:
            self._protocol_error(ch, exc)
            return
        if self.cautious_since is not None:
            log.warning(
                "the broker answers again after %d confirm timeout(s) over %.1fs: publishing "
                "the full window again",
                self._timeouts_in_row,
                self._clock() - self.cautious_since,
            )
            self.cautious_since, self._timeouts_in_row = None, 0
        self._events.answered(events)

    def _returned(self, channel_id: int, message: ReturnedMessage) -> None:
        ch = self.channels.get(channel_id)
        if ch is None:
            return
        try:
            ch.ledger.returned(
                message_id=message.message_id or "",
                reply_code=message.reply_code,
                reply_text=message.reply_text,
            )
        except RemoteProtocolError as exc:
            self._protocol_error(ch, exc)

    def _protocol_error(self, ch: Channel, exc: RemoteProtocolError) -> None:
        """The broker said something impossible on this channel: count it, trust nothing more
        from the channel: its outstanding rows go back (as lost) and it is replaced."""
        self._metrics.protocol_errors += 1
        log.error("broker protocol error: %s; dropping channel %d", exc, ch.id)
        self.channels.pop(ch.id, None)
        self._events.lost(ch.ledger.channel_lost(reason=f"protocol error: {exc}"), PLAIN)
        conn = self.conn
        if conn is not None and conn.is_open:
            self._spawn(self._close_and_reopen(conn, ch.id))

    async def _close_and_reopen(self, conn: AMQPConnection, channel_id: int) -> None:
        await conn.close_channel(channel_id)
        await self._reopen_channels()

    def _channel_closed(self, channel_id: int, reason: CloseReason) -> None:
        ch = self.channels.pop(channel_id, None)
        if ch is None:
            return
        self._metrics.channel_closes += 1
        cause = classify_channel_close(reason)
        log.warning("broker closed channel %d (%s): %s", channel_id, cause.kind.value, reason)
        events = ch.ledger.channel_lost(reason=f"channel {channel_id} closed: {reason}")
        self._events.lost(events, cause)
        if not self.stopping:
            self._spawn(self._reopen_channels())

    async def _reopen_channels(self) -> None:
        if self._reopening:
            return
        self._reopening = True
        try:
            conn = self.conn
            while self._wants_channel(conn):
                assert conn is not None
                cid = await conn.open_channel()
                if conn is self.conn and conn.is_open:
                    self.channels[cid] = Channel(cid, ChannelLedger(channel_id=cid))
                    log.info("reopened confirm channel %d", cid)
                    self._events.connection_changed()
        except (WireError, TimeoutError) as exc:
            log.warning("cannot reopen a channel: %s; dropping the connection", exc)
            if conn is not None:
                conn.abort(reason=f"cannot reopen a channel: {exc}")
        finally:
            self._reopening = False

    def _wants_channel(self, conn: AMQPConnection | None) -> bool:
        return (
            conn is not None
            and conn is self.conn
            and conn.is_open
            and not self.stopping
            and len(self.channels) < self._channel_count(conn)
        )

    def _blocked(self, blocked: bool, reason: str | None) -> None:
        if blocked:
            log.warning("broker blocked publishing: %s", reason or "no reason given")
        else:
            log.info("broker unblocked publishing")
            self._unblocked_at = self._clock()
        self.blocked, self.blocked_reason = blocked, reason
        self._metrics.set_blocked(blocked, reason=reason, now=self._clock())
        self._events.blocked_changed()

    def _connection_lost(self, reason: CloseReason) -> None:
        self._metrics.connected = False
        self._metrics.connection_closes += 1
        if self.blocked:
            self._blocked(False, None)
        cause = classify_connection_loss(reason)
        self._last_cause = cause
        if cause.kind is CloseKind.UNEXPLAINED:
            log.error(
                "the broker closed the connection: %s; blaming its outstanding publishes", reason
            )
        self._abandon(f"connection lost: {reason}", cause)
        self._events.connection_changed()

    def _abandon(self, reason: str, cause: CloseCause) -> None:
        """Every outstanding publish of every channel is lost, as ONE set of suspects."""
        channels = list(self.channels.values())
        self.channels.clear()
        events: list[Event] = []
        lost: list[int] = []
        for ch in channels:
            for event in ch.ledger.channel_lost(reason=reason):
                if isinstance(event, Lost):
                    lost.extend(event.row_ids)
                else:
                    events.append(event)
        if lost:
            events.insert(0, Lost(row_ids=tuple(lost), reason=reason))
        if events:
            self._events.lost(events, cause)

    # ------------------------------------------------------------ housekeeping and stop

    def check_confirm_timeout(self, now: float) -> None:
        conn = self.conn
        grace = self._unblocked_at + self._settings.confirm_timeout
        if conn is None or not conn.is_open or self.blocked or now < grace:
            return
        oldest = self.oldest_outstanding_at()
        if oldest is not None and now - oldest > self._settings.confirm_timeout:
            self._timeouts_in_row += 1
            if self.cautious_since is None:
                self.cautious_since = oldest
                log.error(
                    "no confirm for %.1fs: dropping the connection (its unconfirmed publishes "
                    "go again, counted as lost confirms, no nack budget spent); at most %d "
                    "publishes outstanding until the broker answers again",
                    now - oldest,
                    CAUTIOUS_WINDOW,
                )
            else:
                log.info(
                    "still no confirm: %d confirm timeouts in a row over %.0fs; dropping the "
                    "connection again",
                    self._timeouts_in_row,
                    now - self.cautious_since,
                )
            self._metrics.confirm_timeouts += 1
            conn.abort(reason=f"confirm timeout ({self._settings.confirm_timeout}s)")

    def reconnect(self, reason: str) -> None:
        """Drop the connection (its unconfirmed publishes go again as lost confirms) and
        connect anew, the hosts in a new order."""
        conn = self.conn
        if conn is not None and conn.is_open and not self.stopping:
            log.info("dropping the broker connection to start afresh: %s", reason)
            conn.abort(reason=reason)

    def abandon_window(self, reason: str) -> None:
        """Stop: what is still unconfirmed is of unknown outcome."""
        self._abandon(reason, PLAIN)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    def spawn(self, coro: Any) -> None:
        """Run a helper task (an exchange check) tied to the session's life."""
        self._spawn(coro)

    async def cancel_helpers(self) -> None:
        for task in list(self._aux):
            task.cancel()
        await asyncio.gather(*self._aux, return_exceptions=True)

    async def close(self, timeout: float) -> None:
        conn = self.conn
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close(timeout=timeout)
