"""A TCP proxy on 127.0.0.1 that can black-hole or cut the connections passing through it.

``blackhole()`` stops forwarding in both directions on every open connection but keeps the
sockets open (reading paused, so the sender's buffers fill the way they do when packets vanish):
only a heartbeat or a confirm timeout can tell the client. ``heal()`` drops the black-holed
connections; new connections are forwarded normally unless ``blackhole(new=True)`` was asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

HIGH_WATER = 1 << 20


class _Side(asyncio.Protocol):
    """One socket of a proxied pair; writes what it reads to its peer."""

    def __init__(self, pair: _Pair) -> None:
        self.pair = pair
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        pair = self.pair
        if pair.blackholed:
            return
        cut = False
        if pair.tap is not None:
            if self is pair.client:
                cut = pair.tap.from_client(data)
            else:
                pair.tap.from_server(data)
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
            return
        peer.transport.write(data)
        if cut:
            pair.cut_after_forward()

    def eof_received(self) -> bool | None:
        self.pair.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.close()

    # the peer's write buffer is full: stop reading here until it drains
    def pause_writing(self) -> None:
        other = self.peer
        if other is not None and other.transport is not None and not self.pair.blackholed:
            other.transport.pause_reading()

    def resume_writing(self) -> None:
        other = self.peer
        if other is not None and other.transport is not None and not self.pair.blackholed:
            other.transport.resume_reading()


class Tap(Protocol):
    """Watches one proxied connection; ``from_client`` returning True cuts it right after the
    bytes just read were forwarded to the server."""

    def from_client(self, data: bytes) -> bool: ...

    def from_server(self, data: bytes) -> None: ...


@dataclass(eq=False)
class _Pair:
    opened_at: float
    blackholed: bool = False
    closed: bool = False
    client: _Side | None = None
    upstream: _Side | None = None
    tap: Tap | None = None

    def cut_after_forward(self) -> None:
        """The server gets what was forwarded (then EOF); the client gets a reset, no reply."""
        self.closed = True
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
        if self.client is not None and self.client.transport is not None:
            self.client.transport.abort()

    def sides(self) -> list[_Side]:
        return [s for s in (self.client, self.upstream) if s is not None]

    def blackhole(self) -> None:
        self.blackholed = True
        for side in self.sides():
            if side.transport is not None and not side.transport.is_closing():
                side.transport.pause_reading()

    def close(self, *, abort: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for side in self.sides():
            if side.transport is not None:
                if abort:
                    side.transport.abort()
                else:
                    side.transport.close()


@dataclass
class TcpProxy:
    """``await proxy.start()`` then point a client at ``proxy.url_for(amqp_url)``."""

    upstream_host: str
    upstream_port: int
    listen_host: str = "127.0.0.1"
    port: int = 0
    blackhole_new: bool = False
    tap_factory: Callable[[], Tap] | None = None
    accepted: list[float] = field(default_factory=list)
    _pairs: list[_Pair] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def url_for(self, amqp_url: str) -> str:
        """The same URL (AMQP, or a database's) with host and port swapped for the proxy's."""
        prefix, rest = amqp_url.split("@", 1)
        path = rest.split("/", 1)[1] if "/" in rest else ""
        return f"{prefix}@{self.listen_host}:{self.port}/{path}"

    def _accept(self) -> _Side:
        tap = self.tap_factory() if self.tap_factory is not None else None
        pair = _Pair(opened_at=time.monotonic(), blackholed=self.blackhole_new, tap=tap)
        self._pairs = [p for p in self._pairs if not p.closed]
        self._pairs.append(pair)
        self.accepted.append(pair.opened_at)
        client = _Side(pair)
        pair.client = client
        task = asyncio.get_running_loop().create_task(self._connect_upstream(pair, client))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return client

    async def _connect_upstream(self, pair: _Pair, client: _Side) -> None:
        loop = asyncio.get_running_loop()
        upstream = _Side(pair)
        upstream.peer = client
        try:
            await loop.create_connection(lambda: upstream, self.upstream_host, self.upstream_port)
        except OSError as exc:
            log.info("proxy: upstream refused: %s", exc)
            pair.close(abort=True)
            return
        pair.upstream = upstream
        client.peer = upstream
        if pair.closed:
            pair.close(abort=True)
            return
        if pair.blackholed:
            pair.blackhole()
            return
        assert upstream.transport is not None
        for chunk in client.pending:
            upstream.transport.write(chunk)
        client.pending.clear()

    # ------------------------------------------------------------ faults

    def blackhole(self, *, new: bool = False) -> int:
        """Stop forwarding on every open connection (and on new ones with ``new``)."""
        self.blackhole_new = new
        live = [p for p in self._pairs if not p.closed]
        for pair in live:
            pair.blackhole()
        return len(live)

    def heal(self) -> None:
        """Drop the black-holed connections; forward new ones normally."""
        self.blackhole_new = False
        for pair in self._pairs:
            if pair.blackholed:
                pair.close(abort=True)

    def cut(self) -> None:
        """Reset every open connection now."""
        for pair in self._pairs:
            pair.close(abort=True)

    async def refuse(self) -> None:
        """Refuse connections, as a server that is down does: stop listening (a connect gets
        ECONNREFUSED) and reset every open connection."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()
            self._server = None
        self.cut()

    async def accept(self) -> None:
        """Listen again on the same port after :meth:`refuse`."""
        if self._server is None:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(self._accept, self.listen_host, self.port)

    def open_connections(self) -> int:
        return sum(not p.closed for p in self._pairs)

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()


# ---------------------------------------------------------------- PostgreSQL: a lost COMMIT reply


@dataclass
class LostCommitReply:
    """Cuts a PostgreSQL connection right after the client's ``COMMIT`` of a claim reached the
    server: the transaction commits, the client never learns it (a reset instead of the reply).

    A claim is recognised by its reply: data rows (``UPDATE … RETURNING``) ending in an
    ``UPDATE n`` command tag; settling by ranges, the range claim's rows (``SELECT n``) after
    the client sent it (``INSERT INTO outbox_ranges``), and never a range's settle (an
    ``UPDATE outbox_ranges`` with rows too). Needs ``sslmode=disable`` (plain protocol on the
    wire). Fires ``shots`` times once :meth:`arm` was called; ``fired`` counts.
    """

    shots: int = 1
    armed: bool = False
    fired: int = 0

    def arm(self) -> None:
        self.armed = True

    def tap(self) -> Tap:
        return _PgConnection(self)


_PG_HEADER = struct.Struct(">cI")
_FIRST_FIELD = struct.Struct(">i")  # a data row's first column's length, -1 for NULL


@dataclass(eq=False)
class _PgConnection:
    owner: LostCommitReply
    buffer: bytearray = field(default_factory=bytearray)
    rows_seen: bool = False
    claim_done: bool = False
    range_claim_sent: bool = False  # the client sent a range claim (settling by ranges)
    settle_sent: bool = False  # the client sent a range settle: its UPDATE is no claim

    def from_server(self, data: bytes) -> None:
        self.buffer += data
        buf = self.buffer
        offset = 0
        while len(buf) - offset >= 5:
            kind, length = _PG_HEADER.unpack_from(buf, offset)
            end = offset + 1 + length
            if end > len(buf):
                break
            if kind == b"D":
                # a row whose first column is NULL is no claimed row (a range claim that
                # found nothing answers one such row)
                first = _FIRST_FIELD.unpack_from(buf, offset + 7)[0] if length >= 10 else -1
                self.rows_seen = self.rows_seen or first != -1
            elif kind == b"C":
                tag = bytes(buf[offset + 5 : end]).rstrip(b"\0")
                if tag.startswith(b"UPDATE ") and self.rows_seen and tag != b"UPDATE 0":
                    self.claim_done = self.claim_done or not self.settle_sent
                elif tag.startswith(b"SELECT ") and self.rows_seen and self.range_claim_sent:
                    self.claim_done = self.claim_done or tag != b"SELECT 0"
                self.range_claim_sent = self.settle_sent = False
            elif kind == b"Z":
                self.rows_seen = False
            offset = end
        del buf[:offset]

    def from_client(self, data: bytes) -> bool:
        if b"INSERT INTO outbox_ranges" in data:
            self.range_claim_sent = True
        if b"UPDATE outbox_ranges SET settled_at" in data:
            self.settle_sent = True
        owner = self.owner
        if not (owner.armed and self.claim_done and owner.fired < owner.shots):
            if b"COMMIT" in data or b"ROLLBACK" in data:
                self.claim_done = False
            return False
        if data[:1] == b"Q" and b"COMMIT" in data:
            owner.fired += 1
            self.claim_done = False
            return True
        return False
