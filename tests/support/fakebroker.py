"""A small, scriptable AMQP 0-9-1 broker on loopback for the cases RabbitMQ will not produce on
demand: acks out of order, ``multiple`` acks over gaps, nacks, return-then-ack, a channel closed
mid-window, an ack for a tag never published, ``connection.blocked``, a silent peer.

It speaks just enough for the publisher's wire client (pamqp frames): the handshake, channels,
``confirm.select``, passive ``exchange.declare``, ``basic.publish`` with content frames, closes
and heartbeats. Used in addition to the real-broker tests, never instead of them.

Scripting::

    async with FakeBroker() as broker:            # manual mode: nothing is acked by itself
        ... start the publisher on broker.url ...
        pubs = await broker.wait_published(5)
        pubs[2].connection.ack(pubs[2].channel_id, pubs[2].tag)
        broker.auto_ack = True                    # from now on, ack every publish (multiple)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pamqp import commands, common, frame, header, heartbeat
from pamqp.base import Frame
from pamqp.body import ContentBody

FRAME_MAX = 131_072
_FRAME_END = 0xCE


@dataclass(eq=False)
class Published:
    """One ``basic.publish`` the fake received, with the tag it counts it under."""

    connection: FakeConnection
    channel_id: int
    tag: int
    exchange: str
    routing_key: str
    mandatory: bool
    properties: commands.Basic.Properties
    body: bytes
    #: when it arrived (monotonic), and the channel it came on (channel ids are reused after a
    #: close: this tells one life of channel 1 from the next)
    at: float = field(default_factory=time.monotonic)
    chan: object = None

    @property
    def message_id(self) -> str:
        return self.properties.message_id or ""

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})

    def ack(self, *, multiple: bool = False) -> None:
        self.connection.ack(self.channel_id, self.tag, multiple=multiple)

    def nack(self, *, multiple: bool = False) -> None:
        self.connection.nack(self.channel_id, self.tag, multiple=multiple)

    def send_return(self, reply_code: int = 312, reply_text: str = "NO_ROUTE") -> None:
        self.connection.send_return(self, reply_code, reply_text)


@dataclass
class _Channel:
    confirm: bool = False
    closing: bool = False  # we sent channel.close, waiting for close-ok: drop other frames
    tag: int = 0
    acked_to: int = 0
    method: commands.Basic.Publish | None = None
    props: commands.Basic.Properties | None = None
    size: int = 0
    parts: list[bytes] = field(default_factory=list)


class FakeConnection(asyncio.Protocol):
    """One client connection to the fake broker."""

    def __init__(self, broker: FakeBroker) -> None:
        self.broker = broker
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.greeted = False
        self.open = False
        self.closed = asyncio.get_running_loop().create_future()
        self.channels: dict[int, _Channel] = {}
        self.client_properties: dict[str, Any] = {}
        self.heartbeat = 0
        self.frames_in = 0
        self.body_frames = 0
        self.opened_at = time.monotonic()
        self._beat: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ scripting

    def ack(self, channel_id: int, tag: int, *, multiple: bool = False) -> None:
        self.send(channel_id, commands.Basic.Ack(delivery_tag=tag, multiple=multiple))

    def nack(self, channel_id: int, tag: int, *, multiple: bool = False) -> None:
        self.send(channel_id, commands.Basic.Nack(delivery_tag=tag, multiple=multiple))

    def send_return(
        self, pub: Published, reply_code: int = 312, reply_text: str = "NO_ROUTE"
    ) -> None:
        method = commands.Basic.Return(reply_code, reply_text, pub.exchange, pub.routing_key)
        self.send(pub.channel_id, method)
        self.send(pub.channel_id, header.ContentHeader(0, len(pub.body), pub.properties))
        step = self.broker.frame_max - 8
        for start in range(0, len(pub.body), step):
            self.send(pub.channel_id, ContentBody(pub.body[start : start + step]))

    def close_channel(
        self, channel_id: int, reply_code: int = 504, reply_text: str = "CHANNEL_ERROR"
    ) -> None:
        ch = self.channels.get(channel_id)
        if ch is not None:
            ch.closing = True
        self.send(channel_id, commands.Channel.Close(reply_code, reply_text, 60, 40))

    def block(self, reason: str = "low on memory") -> None:
        self.send(0, commands.Connection.Blocked(reason))

    def unblock(self) -> None:
        self.send(0, commands.Connection.Unblocked())

    def close(self, reply_code: int = 320, reply_text: str = "CONNECTION_FORCED - test") -> None:
        self.send(0, commands.Connection.Close(reply_code, reply_text, 0, 0))

    def drop(self) -> None:
        """Cut the TCP connection without a word."""
        if self.transport is not None:
            self.transport.abort()

    def silence(self) -> None:
        """Stop sending anything (heartbeats included), keep the socket open."""
        self.broker.silent = True
        if self._beat is not None:
            self._beat.cancel()

    # ------------------------------------------------------------ I/O

    def send(self, channel_id: int, value: Frame | header.ContentHeader | ContentBody) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame.marshal(value, channel_id))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.broker.connections.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._beat is not None:
            self._beat.cancel()
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.greeted:
            if len(self.buffer) < 8:
                return
            del self.buffer[:8]
            self.greeted = True
            caps: common.FieldTable = {
                "publisher_confirms": True,
                "basic.nack": True,
                "connection.blocked": True,
            }
            self.send(
                0,
                commands.Connection.Start(
                    server_properties={"product": "fakebroker", "capabilities": caps}
                ),
            )
        self._read_frames()
        if self.broker.auto_ack:
            self._auto_ack()

    def _read_frames(self) -> None:
        buf = self.buffer
        offset = 0
        while len(buf) - offset >= 8:
            size = int.from_bytes(buf[offset + 3 : offset + 7], "big")
            end = offset + 8 + size
            if end > len(buf):
                break
            assert buf[end - 1] == _FRAME_END, "bad frame end from the client"
            if size + 8 > self.broker.frame_max:
                self.broker.frame_errors.append(size + 8)
            _, channel_id, value = frame.unmarshal(bytes(buf[offset:end]))
            offset = end
            self.frames_in += 1
            self._handle(channel_id, value)
        del buf[:offset]

    def _handle(self, channel_id: int, value: Any) -> None:
        if isinstance(value, heartbeat.Heartbeat):
            return
        if channel_id == 0:
            self._handle_connection(value)
            return
        ch = self.channels.get(channel_id)
        if isinstance(value, commands.Channel.Open):
            self.channels[channel_id] = _Channel()
            self.send(channel_id, commands.Channel.OpenOk())
        elif ch is None:
            return
        elif ch.closing:
            if isinstance(value, commands.Channel.CloseOk | commands.Channel.Close):
                del self.channels[channel_id]
                if isinstance(value, commands.Channel.Close):
                    self.send(channel_id, commands.Channel.CloseOk())
        else:
            self._handle_channel(channel_id, ch, value)

    def _handle_connection(self, value: Any) -> None:
        if isinstance(value, commands.Connection.StartOk):
            self.client_properties = dict(value.client_properties or {})
            self.send(
                0, commands.Connection.Tune(2047, self.broker.frame_max, self.broker.heartbeat)
            )
        elif isinstance(value, commands.Connection.TuneOk):
            self.heartbeat = value.heartbeat or 0
            if self.heartbeat:
                self._schedule_beat()
        elif isinstance(value, commands.Connection.Open):
            self.open = True
            self.send(0, commands.Connection.OpenOk())
        elif isinstance(value, commands.Connection.Close):
            self.send(0, commands.Connection.CloseOk())
            if self.transport is not None:
                self.transport.close()
        elif isinstance(value, commands.Connection.CloseOk) and self.transport is not None:
            self.transport.close()

    def _schedule_beat(self) -> None:
        loop = asyncio.get_running_loop()
        self._beat = loop.call_later(self.heartbeat / 2, self._send_beat)

    def _send_beat(self) -> None:
        if self.broker.silent:
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(heartbeat.Heartbeat.marshal())
            self._schedule_beat()

    def _handle_channel(self, channel_id: int, ch: _Channel, value: Any) -> None:
        if isinstance(value, commands.Confirm.Select):
            ch.confirm = True
            self.send(channel_id, commands.Confirm.SelectOk())
        elif isinstance(value, commands.Exchange.Declare):
            self._declare(channel_id, ch, value)
        elif isinstance(value, commands.Channel.Close):
            del self.channels[channel_id]
            self.send(channel_id, commands.Channel.CloseOk())
        elif isinstance(value, commands.Basic.Publish):
            ch.method, ch.props, ch.size, ch.parts = value, None, 0, []
        elif isinstance(value, header.ContentHeader):
            ch.props, ch.size = value.properties, value.body_size
            if ch.size == 0:
                self._published(channel_id, ch)
        elif isinstance(value, ContentBody):
            self.body_frames += 1
            ch.parts.append(value.value)
            if sum(len(p) for p in ch.parts) >= ch.size:
                self._published(channel_id, ch)

    def _declare(self, channel_id: int, ch: _Channel, value: commands.Exchange.Declare) -> None:
        name = value.exchange or ""
        if name in self.broker.missing_exchanges:
            ch.closing = True
            self.send(
                channel_id,
                commands.Channel.Close(
                    404, f"NOT_FOUND - no exchange '{name}' in vhost '/'", 40, 10
                ),
            )
        else:
            self.send(channel_id, commands.Exchange.DeclareOk())

    def _published(self, channel_id: int, ch: _Channel) -> None:
        assert ch.method is not None
        body = b"".join(ch.parts)
        method, props = ch.method, ch.props or commands.Basic.Properties()
        ch.method = None
        exchange = method.exchange or ""
        if exchange in self.broker.missing_exchanges:
            ch.closing = True
            text = f"NOT_FOUND - no exchange '{exchange}' in vhost '/'"
            self.send(channel_id, commands.Channel.Close(404, text, 60, 40))
            return
        limit = self.broker.max_message_size
        if limit is not None and len(body) > limit:
            ch.closing = True
            text = (
                f"PRECONDITION_FAILED - message size {len(body)} is larger than configured "
                f"max size {limit}"
            )
            self.send(channel_id, commands.Channel.Close(406, text, 60, 40))
            return
        ch.tag += 1 if ch.confirm else 0
        pub = Published(
            self,
            channel_id,
            ch.tag,
            exchange,
            method.routing_key or "",
            bool(method.mandatory),
            props,
            body,
            chan=ch,
        )
        self.broker._record(pub)

    def _auto_ack(self) -> None:
        for channel_id, ch in self.channels.items():
            if ch.confirm and not ch.closing and ch.tag > ch.acked_to:
                ch.acked_to = ch.tag
                self.ack(channel_id, ch.tag, multiple=True)


class FakeBroker:
    """The server. ``auto_ack``: ack every publish (multiple, per read); else the test acks."""

    def __init__(
        self, *, auto_ack: bool = False, heartbeat: int = 0, frame_max: int = FRAME_MAX
    ) -> None:
        self.auto_ack = auto_ack
        self.heartbeat = heartbeat
        self.frame_max = frame_max
        self.missing_exchanges: set[str] = set()
        self.max_message_size: int | None = None
        self.silent = False
        self.frame_errors: list[int] = []  # sizes of client frames above frame_max
        self.connections: list[FakeConnection] = []
        self.published: list[Published] = []
        self.on_publish: Callable[[Published], None] | None = None
        self._server: asyncio.Server | None = None
        self._changed = asyncio.Event()
        self.port = 0

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    async def start(self) -> FakeBroker:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FakeConnection(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in self.connections:
            conn.drop()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self._server.wait_closed()

    async def __aenter__(self) -> FakeBroker:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start_auto_ack(self) -> None:
        """Ack everything outstanding now, and every publish from now on."""
        self.auto_ack = True
        for conn in self.connections:
            conn._auto_ack()

    def _record(self, pub: Published) -> None:
        self.published.append(pub)
        if self.on_publish is not None:
            self.on_publish(pub)
        self._changed.set()

    @property
    def connection(self) -> FakeConnection:
        """The newest connection."""
        return self.connections[-1]

    async def wait_for(self, predicate: Callable[[], bool], *, timeout: float = 10.0) -> None:
        """Wait (bounded) until ``predicate()`` holds; it is checked on every publish and 20 ms."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.02):
                        await self._changed.wait()

    async def wait_published(self, count: int, *, timeout: float = 10.0) -> list[Published]:
        """Wait until ``count`` publishes arrived in total; return them all."""
        await self.wait_for(lambda: len(self.published) >= count, timeout=timeout)
        return list(self.published)

    async def wait_connections(self, count: int, *, timeout: float = 10.0) -> FakeConnection:
        await self.wait_for(
            lambda: sum(1 for c in self.connections if c.open) >= count, timeout=timeout
        )
        return self.connection
