"""A tiny HTTP server for a process's own ``/metrics``, ``/healthz`` and ``/readyz``.

The publisher (and any other long-running process of the product) serves its probes on a port of
its own, loopback by default, from the event loop it already runs: no web framework, no thread.
It answers ``GET`` and ``HEAD`` of the paths it is given, one request per connection, with bounded
reads and a timeout, so a slow or hostile scraper cannot hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD = 8192
READ_TIMEOUT = 5.0
REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    503: "Service Unavailable",
    500: "Internal Server Error",
}


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    content_type: str
    body: bytes

    @classmethod
    def json(cls, status: int, doc: object) -> Response:
        return cls(status, "application/json", json.dumps(doc, default=str).encode() + b"\n")


Route = Callable[[], Response]


def metrics_route(registry: CollectorRegistry) -> Route:
    return lambda: Response(200, CONTENT_TYPE_LATEST, generate_latest(registry))


def check_route(check: Callable[[], tuple[bool, dict[str, object]]]) -> Route:
    """A probe: 200 with the details when ``check`` passes, 503 with them when it does not."""

    def route() -> Response:
        ok, details = check()
        return Response.json(200 if ok else 503, {"ok": ok, **details})

    return route


class ProbeServer:
    """Serves ``routes`` on ``host:port`` (port 0: any free port, see :attr:`url`)."""

    def __init__(self, routes: Mapping[str, Route], *, host: str, port: int) -> None:
        self._routes = dict(routes)
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str | None:
        if self._server is None or not self._server.sockets:
            return None
        host, port = self._server.sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            response, head_only = await self._answer(reader)
            writer.write(self._encode(response, head_only))
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[Response, bool]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
        except asyncio.LimitOverrunError:
            return Response(400, "text/plain", b"request head too large\n"), False
        if len(head) > MAX_REQUEST_HEAD:
            return Response(400, "text/plain", b"request head too large\n"), False
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            return Response(400, "text/plain", b"bad request line\n"), False
        method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
        route = self._routes.get(target.split("?", 1)[0])
        if route is None:
            return Response(404, "text/plain", b"not found\n"), False
        if method not in ("GET", "HEAD"):
            return Response(405, "text/plain", b"GET or HEAD only\n"), False
        try:
            return route(), method == "HEAD"
        except Exception:
            log.exception("probe %s failed", target)
            return Response(500, "text/plain", b"probe failed\n"), False

    @staticmethod
    def _encode(response: Response, head_only: bool) -> bytes:
        reason = REASONS.get(response.status, "")
        head = (
            f"HTTP/1.1 {response.status} {reason}\r\nContent-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        return head if head_only else head + response.body
