"""Where and as whom to connect: ``amqp://`` and ``amqps://`` URLs parsed into parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True, slots=True)
class AMQPParams:
    """Where and as whom to connect, parsed from an ``amqp://`` or ``amqps://`` URL."""

    host: str
    port: int
    vhost: str
    username: str
    password: str = field(repr=False)
    tls: bool = False


def parse_url(url: str) -> AMQPParams:
    """``amqp://user:pass@host:port/vhost`` -> :class:`AMQPParams` (vhost ``/`` by default)."""
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps"):
        raise ValueError(f"not an AMQP URL (scheme {parts.scheme!r})")
    tls = parts.scheme == "amqps"
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    return AMQPParams(
        host=parts.hostname or "localhost",
        port=parts.port or (5671 if tls else 5672),
        vhost=unquote(path) if path else "/",
        username=unquote(parts.username or "guest"),
        password=unquote(parts.password or "guest"),
        tls=tls,
    )
