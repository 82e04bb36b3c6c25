"""What the API reads, bounded: request bodies by size before anything parses them (and before
any token check), JSON strictly, and failed authentications per client.

- :class:`BodyLimit` (ASGI middleware, outermost): a declared ``Content-Length`` over the limit
  is answered 413 without reading a byte; a body without one (chunked) is counted as it streams
  and cut off at the limit.
- :class:`StrictJsonRoute`: a JSON body with a duplicate key, ``NaN``/``Infinity``, a number
  out of range or a lone surrogate is a 400 naming the problem (Python's ``json`` accepts all
  four: the last duplicate would silently win, ``"dry_run": true, "dry_run": false`` included).
- :class:`AuthThrottle`: after ``max_failures`` failed authentications from one client address
  within ``window`` seconds, that client gets 429 with ``Retry-After`` until the window passes.
"""

from __future__ import annotations

import ipaddress
import json
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.hosts import is_loopback

JSON_MEDIA = "application/json"


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _too_large(send, self.max_bytes)
            return
        seen = 0
        refused = False

        async def counted() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    raise _BodyTooLarge
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _too_large(send, self.max_bytes)
        except Exception:
            if not refused:
                raise
            if not started:
                await _too_large(send, self.max_bytes)


class _BodyTooLarge(Exception):
    pass


class LoopbackHostOnly:
    """Insecure mode (no tokens, loopback only): a request must name a loopback host. A page on
    another site that rebinds its DNS name to 127.0.0.1 reaches the port, but its requests say
    ``Host: evil.example``: answered 421, never an operator session (DNS rebinding)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _loopback_host(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "type": "about:blank",
                "title": "Misdirected Request",
                "status": 421,
                "detail": "insecure mode answers requests for a loopback host only "
                "(localhost, 127.0.0.1, [::1])",
            }
        ).encode()
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 421, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _loopback_host(scope: Scope) -> bool:
    host = next((v for k, v in scope.get("headers", []) if k == b"host"), b"")
    try:
        name = urlsplit("//" + host.decode("ascii")).hostname or ""
    except (UnicodeDecodeError, ValueError):
        return False
    return is_loopback(name)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        {
            "type": "about:blank",
            "title": "Request body too large",
            "status": 413,
            "detail": f"the request body is over {limit} bytes",
        }
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ------------------------------------------------------------------------------ strict JSON


class JsonError(ValueError):
    """A request body that is not strict JSON."""


def strict_loads(raw: bytes) -> Any:
    """RFC 8259 JSON and nothing more: UTF-8, no duplicate keys, no NaN/Infinity, finite numbers,
    no lone surrogates. Raises :class:`JsonError` saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"the body is not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_float=_finite
        )
    except json.JSONDecodeError as exc:
        raise JsonError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # 60 KB of "[" was a 500 with a traceback
        raise JsonError("nested too deeply") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise JsonError("nested too deeply") from None
    except UnicodeEncodeError:
        raise JsonError(
            "a string holds a lone surrogate (\\ud800-\\udfff): not valid Unicode"
        ) from None
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonError(f"duplicate key {key!r}: which value is meant is a guess")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise JsonError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"number {text[:40]} is out of range")
    return value


class StrictJsonRoute(APIRoute):
    """Parses a JSON body with :func:`strict_loads` before FastAPI does (a 400 otherwise), after
    :meth:`before_body` (the token check of :class:`app.api.auth.TokenJsonRoute`): a body sent
    without a valid token is never parsed, and counts as a failed authentication."""

    def before_body(self, request: Request) -> None:
        """Runs before a body is parsed (nothing here)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                raw = await request.body()
                if raw:
                    self.before_body(request)
                    ctype = request.headers.get("content-type", "").split(";")[0].strip()
                    if ctype != JSON_MEDIA:
                        raise HTTPException(
                            415, f"send the body as {JSON_MEDIA}, not {ctype or 'no Content-Type'}"
                        )
                    try:
                        request._json = strict_loads(raw)  # read by FastAPI's body parsing
                    except JsonError as exc:
                        raise HTTPException(400, f"malformed JSON body: {exc}") from None
            return await handler(request)

        return strict


# ------------------------------------------------------------------------------ throttling


class AuthThrottle:
    """Failed authentications per client address, in a sliding window (in memory, per
    process: behind several API replicas each counts its own). An IPv6 client counts by its
    /64 (one host holds a whole /64: one address each try would otherwise never be throttled);
    past ``max_clients`` the client that failed least recently is forgotten, in O(1)."""

    def __init__(
        self,
        *,
        max_failures: int = 20,
        window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        self.max_failures = max_failures
        self.window = window
        self.clock = clock
        self.max_clients = max_clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def check(self, client: str) -> None:
        """429 while ``client`` is over its budget of failures."""
        times = self._recent(client_key(client))
        if len(times) >= self.max_failures:
            wait = max(1, math.ceil(times[0] + self.window - self.clock()))
            raise HTTPException(
                429,
                f"too many failed authentications from {client}; retry in {wait}s",
                {"Retry-After": str(wait)},
            )

    def failed(self, client: str) -> None:
        key = client_key(client)
        self._recent(key).append(self.clock())
        self._failures.move_to_end(key)
        while len(self._failures) > self.max_clients:  # bounded under a spray of addresses
            self._failures.popitem(last=False)

    def _recent(self, key: str) -> deque[float]:
        times = self._failures.setdefault(key, deque())
        horizon = self.clock() - self.window
        while times and times[0] < horizon:
            times.popleft()
        return times


def client_key(client: str) -> str:
    """What the throttle counts by: the address, or an IPv6 address's /64."""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client
    if address.version == 6 and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return client
