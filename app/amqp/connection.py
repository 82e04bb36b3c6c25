"""The asyncio half of the AMQP client: one connection, its channels, the broker's callbacks.

aio-pika (aiormq underneath) gives every publish its own socket write and its own asyncio future;
that caps a Python publisher near 5k msg/s on this kind of machine (docs/publisher.md). Here a
batch of publishes is marshalled into one buffer (:mod:`app.amqp.codec`) and written with one
``transport.write``, and the broker's answers go to plain synchronous callbacks
(:class:`WireListener`): no future per message.

What it speaks: the handshake (capabilities for confirms, ``connection.blocked`` and
authentication-failure close), channels in confirm mode, ``basic.publish``, passive
``exchange.declare`` on a scratch channel, heartbeats (sent, and missed ones detected),
``connection.blocked``/``unblocked``, ``basic.ack``/``nack``/``return`` and channel/connection
closes from either side. Futures exist only for the few control RPCs (channel open,
confirm.select, passive declare, close). Channel numbers stay within the broker's ``channel_max``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pamqp import commands, header
from pamqp.base import Frame
from pamqp.body import ContentBody

from app.amqp.codec import (
    DEFAULT_FRAME_MAX,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    FrameReader,
    FramingError,
    OutgoingMessage,
    PublishEncoder,
    ReturnAssembler,
    ReturnedMessage,
    method_frame,
)
from app.amqp.dial import dial, tls_refusal
from app.amqp.errors import (
    ACCESS_REFUSED,
    CONNECTION_FORCED,
    FRAME_ERROR,
    REPLY_SUCCESS,
    AuthenticationError,
    ChannelClosedError,
    ChannelLimitError,
    CloseReason,
    ConnectionClosedError,
    HandshakeError,
    WireError,
)
from app.amqp.params import AMQPParams, parse_url, start_ok

log = logging.getLogger(__name__)


class WireListener(Protocol):
    """Synchronous callbacks for everything the broker sends unasked. Keep them short."""

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None: ...

    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None: ...

    def on_return(self, channel_id: int, message: ReturnedMessage) -> None: ...

    def on_channel_closed(self, channel_id: int, reason: CloseReason) -> None: ...

    def on_blocked(self, reason: str) -> None: ...

    def on_unblocked(self) -> None: ...

    def on_connection_lost(self, reason: CloseReason) -> None: ...


def _close_reason(method: commands.Connection.Close | commands.Channel.Close) -> CloseReason:
    return CloseReason(
        method.reply_code or 0,
        method.reply_text or "",
        method.class_id or 0,
        method.method_id or 0,
        by_peer=True,
    )


# ---------------------------------------------------------------- the connection


@dataclass(slots=True)
class _Waiter:
    expect: tuple[type[Frame], ...]
    future: asyncio.Future[Frame]


class AMQPConnection(asyncio.Protocol):
    """One AMQP connection. Build it with :meth:`connect`; it calls ``listener`` from the loop."""

    def __init__(
        self,
        *,
        listener: WireListener,
        params: AMQPParams,
        heartbeat: int,
        frame_max: int,
        channel_max: int,
        name: str,
    ) -> None:
        self._listener = listener
        self._params = params
        self._want_heartbeat = heartbeat
        self._want_frame_max = frame_max
        self._want_channel_max = channel_max
        self._name = name
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._waiters: dict[int, _Waiter] = {}
        self._channels: set[int] = set()  # open channels (confirm mode or scratch)
        self._notify_channels: set[int] = set()  # channels whose closes go to the listener
        self._returns = ReturnAssembler()
        self._next_channel = 1
        self._scratch: int | None = None
        self._scratch_lock = asyncio.Lock()
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._handshake_done = False
        self._started = False  # the broker's connection.start arrived
        self.address: tuple[str, int] | None = None  # the broker connected to (host, port)
        self._closed: CloseReason | None = None
        self._close_sent = False
        self._lost = self._loop.create_future()
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        self._last_recv = time.monotonic()
        self.server_properties: dict[str, Any] = {}
        self.frame_max = DEFAULT_FRAME_MAX
        self.channel_max = channel_max
        self.heartbeat = 0
        self.blocked = False
        self.encoder = PublishEncoder(frame_max=DEFAULT_FRAME_MAX)
        self.bytes_written = 0
        self.writes = 0

    # ------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        listener: WireListener,
        heartbeat: int = 10,
        frame_max: int = DEFAULT_FRAME_MAX,
        channel_max: int = 2047,
        timeout: float = 10.0,
        name: str = "outbox-publisher",
        shuffle: random.Random | None = None,
        try_last: tuple[str, int] | None = None,
    ) -> AMQPConnection:
        """Open a TCP (or TLS) connection and run the AMQP handshake, trying the URL's brokers
        in order (``shuffle``: in an order drawn from it, so that publishers spread over a
        cluster's nodes and, reconnecting, come back to a recovered one; ``try_last``: a broker to
        try after the others, see :func:`try_order`); the error names each broker tried and
        why it failed."""
        params = parse_url(url)
        tls = params.ssl_context()

        async def open_one(host: str, port: int) -> AMQPConnection:
            proto = cls(
                listener=listener,
                params=params,
                heartbeat=heartbeat,
                frame_max=frame_max,
                channel_max=channel_max,
                name=name,
            )
            server_hostname = params.server_hostname(host)
            await proto._open(host, port, tls=tls, server_hostname=server_hostname, timeout=timeout)
            return proto

        return await dial(params, open_one, shuffle=shuffle, last=try_last)

    async def _open(
        self,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        timeout: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            await loop.create_connection(
                lambda: self, host, port, ssl=tls, server_hostname=server_hostname
            )
            self.address = (host, port)
            try:
                await self._handshake()
            except BaseException:
                self.abort()
                raise

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.set_write_buffer_limits(high=4 << 20, low=1 << 20)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = self._closed or CloseReason(
            CONNECTION_FORCED, f"connection lost: {exc or 'closed by peer'}", by_peer=True
        )
        self._closed = reason
        self._stop_heartbeats()
        error: WireError = ConnectionClosedError(reason)
        if self._params.tls and not self._started:
            error = tls_refusal(exc, self._params)
        for waiter in self._waiters.values():
            if not waiter.future.done():
                waiter.future.set_exception(error)
        self._waiters.clear()
        self._wake_drainers()
        self._channels.clear()
        if not self._lost.done():
            self._lost.set_result(reason)
        if self._handshake_done:
            self._listener.on_connection_lost(reason)

    @property
    def is_open(self) -> bool:
        return self._closed is None and self._handshake_done

    async def wait_closed(self) -> CloseReason:
        return await asyncio.shield(self._lost)

    async def close(self, *, timeout: float = 5.0) -> None:
        """Close politely (``connection.close``, wait for ``close-ok``), then the socket."""
        if self._transport is None or self._lost.done():
            return
        if self.is_open and not self._close_sent:
            self._closed = CloseReason(REPLY_SUCCESS, "closed by client", by_peer=False)
            self._close_sent = True
            self._write(method_frame(0, commands.Connection.Close(REPLY_SUCCESS, "bye", 0, 0)))
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._lost)
        except TimeoutError:
            self.abort(reason="close timed out")

    def abort(self, *, reason: str = "aborted by client") -> None:
        """Drop the socket now: outstanding publishes become of unknown outcome."""
        if self._closed is None:
            self._closed = CloseReason(CONNECTION_FORCED, reason, by_peer=False)
        if self._transport is not None:
            self._transport.abort()

    # ------------------------------------------------------------ handshake

    async def _handshake(self) -> None:
        start = await self._request(0, None, (commands.Connection.Start,), raw=PROTOCOL_HEADER)
        assert isinstance(start, commands.Connection.Start)
        self._started = True
        self.server_properties = dict(start.server_properties or {})
        mechanisms = start.mechanisms
        if isinstance(mechanisms, bytes):
            mechanisms = mechanisms.decode()
        wanted = self._params.auth.upper()
        if wanted not in str(mechanisms).split():
            hint = (
                " (enable the rabbitmq_auth_mechanism_ssl plugin and auth_mechanisms)"
                if wanted == "EXTERNAL"
                else ""
            )
            raise HandshakeError(
                f"broker offers no {wanted} authentication (it offers {mechanisms}){hint}"
            )
        tune = await self._request(
            0, start_ok(self._params, name=self._name), (commands.Connection.Tune,)
        )
        assert isinstance(tune, commands.Connection.Tune)
        self._apply_tune(tune)
        self._write(
            method_frame(
                0, commands.Connection.TuneOk(self.channel_max, self.frame_max, self.heartbeat)
            )
        )
        await self._request(
            0, commands.Connection.Open(self._params.vhost), (commands.Connection.OpenOk,)
        )
        self._handshake_done = True
        self._start_heartbeats()

    def _apply_tune(self, tune: commands.Connection.Tune) -> None:
        def lowest(ours: int, theirs: int) -> int:
            return min(x for x in (ours, theirs) if x) if (ours or theirs) else 0

        self.channel_max = lowest(self._want_channel_max, tune.channel_max or 0) or 65535
        self.frame_max = lowest(self._want_frame_max, tune.frame_max or 0) or DEFAULT_FRAME_MAX
        self.heartbeat = self._want_heartbeat
        self.encoder = PublishEncoder(frame_max=self.frame_max)

    # ------------------------------------------------------------ heartbeats

    def _start_heartbeats(self) -> None:
        if self.heartbeat > 0:
            self._last_recv = time.monotonic()
            self._heartbeat_timer = self._loop.call_later(self.heartbeat / 2, self._heartbeat_tick)

    def _stop_heartbeats(self) -> None:
        if self._heartbeat_timer is not None:
            self._heartbeat_timer.cancel()
            self._heartbeat_timer = None

    def _heartbeat_tick(self) -> None:
        if self._closed is not None:
            return
        if time.monotonic() - self._last_recv > 2 * self.heartbeat:
            log.warning("no frame from the broker for %ss: connection dead", 2 * self.heartbeat)
            self.abort(reason=f"missed heartbeats ({2 * self.heartbeat}s without a frame)")
            return
        self._write(HEARTBEAT_FRAME)
        self._heartbeat_timer = self._loop.call_later(self.heartbeat / 2, self._heartbeat_tick)

    # ------------------------------------------------------------ channels

    def _allocate_channel(self) -> int:
        for _ in range(self.channel_max):
            channel_id = self._next_channel
            self._next_channel = channel_id % self.channel_max + 1
            if channel_id not in self._channels and channel_id not in self._waiters:
                return channel_id
        raise ChannelLimitError(f"all {self.channel_max} channels the broker allows are in use")

    async def open_channel(self, *, confirm: bool = True) -> int:
        """Open a channel (in confirm mode by default); its closes go to the listener."""
        channel_id = self._allocate_channel()
        await self._request(channel_id, commands.Channel.Open(), (commands.Channel.OpenOk,))
        self._channels.add(channel_id)
        if confirm:
            await self._request(channel_id, commands.Confirm.Select(), (commands.Confirm.SelectOk,))
        self._notify_channels.add(channel_id)
        return channel_id

    async def close_channel(self, channel_id: int, *, timeout: float = 5.0) -> None:
        """Close a channel of ours; frames still arriving for it are dropped."""
        self._notify_channels.discard(channel_id)
        if channel_id not in self._channels or not self.is_open:
            self._channels.discard(channel_id)
            return
        try:
            async with asyncio.timeout(timeout):
                await self._request(
                    channel_id,
                    commands.Channel.Close(REPLY_SUCCESS, "done", 0, 0),
                    (commands.Channel.CloseOk,),
                )
        except (WireError, TimeoutError):
            pass
        self._channels.discard(channel_id)

    def channel_is_open(self, channel_id: int) -> bool:
        return channel_id in self._channels

    async def exchange_exists(
        self, name: str, *, timeout: float = 5.0, channel: int | None = None
    ) -> CloseReason | None:
        """Passive ``exchange.declare``: None if the exchange exists, else why not.

        Runs on a scratch channel of its own, or on ``channel`` when given (a caller with no
        channel number to spare: it must have nothing outstanding there, since a missing
        exchange closes that channel). Raises ChannelLimitError when no scratch channel can be
        opened.
        """
        declare = commands.Exchange.Declare(exchange=name, passive=True)
        if channel is not None:
            try:
                async with asyncio.timeout(timeout):
                    await self._request(channel, declare, (commands.Exchange.DeclareOk,))
            except ChannelClosedError as exc:
                return exc.reason
            return None
        async with self._scratch_lock:
            if self._scratch is None or self._scratch not in self._channels:
                self._scratch = None
                channel_id = self._allocate_channel()
                async with asyncio.timeout(timeout):
                    await self._request(
                        channel_id, commands.Channel.Open(), (commands.Channel.OpenOk,)
                    )
                self._channels.add(channel_id)
                self._scratch = channel_id
            try:
                async with asyncio.timeout(timeout):
                    await self._request(self._scratch, declare, (commands.Exchange.DeclareOk,))
            except ChannelClosedError as exc:
                self._scratch = None
                return exc.reason
            return None

    async def call(
        self,
        channel_id: int,
        method: Frame,
        expect: tuple[type[Frame], ...],
        *,
        timeout: float = 10.0,
    ) -> Frame:
        """One synchronous method on an open channel (``exchange.declare``, ``queue.bind``...);
        raises ChannelClosedError with the broker's reason when it refuses."""
        async with asyncio.timeout(timeout):
            return await self._request(channel_id, method, expect)

    # ------------------------------------------------------------ publishing

    def encode_batch(
        self, channel_id: int, messages: Sequence[OutgoingMessage]
    ) -> tuple[bytes, list[tuple[int, Exception]]]:
        """Marshal publishes into one buffer (nothing is sent); see ``PublishEncoder``."""
        return self.encoder.encode_batch(channel_id, messages)

    def write_batch(self, channel_id: int, data: bytes) -> None:
        """Send publishes encoded by :meth:`encode_batch` with one ``transport.write``.

        Raises ChannelClosedError / ConnectionClosedError (nothing sent) when they cannot go.
        """
        if not self.is_open:
            raise ConnectionClosedError(self._closed or CloseReason(CONNECTION_FORCED, "not open"))
        if channel_id not in self._channels:
            raise ChannelClosedError(channel_id, CloseReason(0, "channel is not open"))
        if data:
            self._write(data)

    def publish_batch(
        self, channel_id: int, messages: Sequence[OutgoingMessage]
    ) -> list[tuple[int, Exception]]:
        """:meth:`encode_batch` then :meth:`write_batch`: one write for the whole batch."""
        data, errors = self.encode_batch(channel_id, messages)
        self.write_batch(channel_id, data)
        return errors

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    async def drain(self) -> None:
        """Wait while the socket's write buffer is above its high-water mark."""
        if not self._write_paused or self._lost.done():
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drainers()

    def _wake_drainers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _write(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        self._transport.write(data)
        self.bytes_written += len(data)
        self.writes += 1

    async def _request(
        self,
        channel_id: int,
        method: Frame | None,
        expect: tuple[type[Frame], ...],
        *,
        raw: bytes | None = None,
    ) -> Frame:
        if self._closed is not None:
            raise ConnectionClosedError(self._closed)
        if channel_id in self._waiters:
            raise WireError(f"channel {channel_id} already has a request in flight")
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._waiters[channel_id] = _Waiter(expect, future)
        self._write(raw if raw is not None else method_frame(channel_id, method))  # type: ignore[arg-type]
        try:
            return await future
        finally:
            waiter = self._waiters.get(channel_id)
            if waiter is not None and waiter.future is future:
                del self._waiters[channel_id]

    # ------------------------------------------------------------ reading

    def data_received(self, data: bytes) -> None:
        self._last_recv = time.monotonic()
        if not self._handshake_done and self._reader.starts_with_protocol_header(data):
            self._fail_handshake(f"broker wants protocol {bytes(data[:8])!r}")
            return
        try:
            for channel_id, value in self._reader.feed(data):
                self._dispatch(channel_id, value)
                if self._transport is None or self._transport.is_closing():
                    return
        except FramingError as exc:
            self._protocol_violation(str(exc))

    def _fail_handshake(self, why: str) -> None:
        for waiter in self._waiters.values():
            if not waiter.future.done():
                waiter.future.set_exception(HandshakeError(why))
        self.abort(reason=why)

    def _protocol_violation(self, why: str) -> None:
        log.error("AMQP framing error from the broker: %s", why)
        if self._closed is None:
            self._closed = CloseReason(FRAME_ERROR, why, by_peer=False)
            self._write(method_frame(0, commands.Connection.Close(FRAME_ERROR, why[:200], 0, 0)))
        self.abort(reason=why)

    def _dispatch(self, channel_id: int, value: Any) -> None:
        if isinstance(value, commands.Basic.Ack):
            if channel_id in self._notify_channels:
                self._listener.on_ack(channel_id, value.delivery_tag, value.multiple)
        elif isinstance(value, commands.Basic.Nack):
            if channel_id in self._notify_channels:
                self._listener.on_nack(channel_id, value.delivery_tag, value.multiple)
        elif isinstance(value, commands.Basic.Return):
            self._returns.start(channel_id, value)
        elif isinstance(value, header.ContentHeader):
            self._returned(channel_id, self._returns.header(channel_id, value))
        elif isinstance(value, ContentBody):
            self._returned(channel_id, self._returns.body(channel_id, value.value))
        elif channel_id == 0:
            self._dispatch_connection(value)
        else:
            self._dispatch_channel(channel_id, value)

    def _resolve(self, channel_id: int, value: Frame) -> bool:
        waiter = self._waiters.get(channel_id)
        if waiter is None or not isinstance(value, waiter.expect):
            return False
        if not waiter.future.done():
            waiter.future.set_result(value)
        return True

    def _dispatch_connection(self, value: Any) -> None:
        if self._resolve(0, value):
            return
        if isinstance(value, commands.Connection.Close):
            reason = _close_reason(value)
            self._closed = self._closed or reason
            self._write(method_frame(0, commands.Connection.CloseOk()))
            if not self._handshake_done:
                self._fail_waiters(reason)
            if self._transport is not None:
                self._transport.close()
        elif isinstance(value, commands.Connection.CloseOk):
            if self._transport is not None:
                self._transport.close()
        elif isinstance(value, commands.Connection.Blocked):
            self.blocked = True
            self._listener.on_blocked(value.reason or "")
        elif isinstance(value, commands.Connection.Unblocked):
            self.blocked = False
            self._listener.on_unblocked()
        else:
            log.debug("ignored connection frame %s", getattr(value, "name", value))

    def _fail_waiters(self, reason: CloseReason) -> None:
        error: Exception = ConnectionClosedError(reason)
        if reason.reply_code == ACCESS_REFUSED:
            error = AuthenticationError(f"broker refused the login: {reason}")
        for waiter in self._waiters.values():
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _dispatch_channel(self, channel_id: int, value: Any) -> None:
        if isinstance(value, commands.Channel.Close):
            self._on_channel_close(channel_id, value)
        elif self._resolve(channel_id, value):
            return
        elif isinstance(value, commands.Channel.Flow):
            self._write(method_frame(channel_id, commands.Channel.FlowOk(value.active)))
        else:
            log.debug("ignored frame %s on channel %d", getattr(value, "name", value), channel_id)

    def _on_channel_close(self, channel_id: int, value: commands.Channel.Close) -> None:
        reason = _close_reason(value)
        self._write(method_frame(channel_id, commands.Channel.CloseOk()))
        self._channels.discard(channel_id)
        self._returns.drop(channel_id)
        waiter = self._waiters.pop(channel_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_exception(ChannelClosedError(channel_id, reason))
        if channel_id in self._notify_channels:
            self._notify_channels.discard(channel_id)
            self._listener.on_channel_closed(channel_id, reason)

    def _returned(self, channel_id: int, message: ReturnedMessage | None) -> None:
        if message is not None and channel_id in self._notify_channels:
            self._listener.on_return(channel_id, message)
