"""Where the stream protocol is: the URL of one node or of a cluster's nodes, parsed."""

from __future__ import annotations

import dataclasses
from urllib.parse import unquote, urlsplit

from app.settings import Settings


@dataclasses.dataclass(frozen=True, slots=True)
class StreamEndpoint:
    """Where the stream protocol is: one or more nodes (``host:port``), tried in turn."""

    addresses: tuple[tuple[str, int], ...]
    username: str
    password: str
    vhost: str

    @property
    def host(self) -> str:
        return self.addresses[0][0]

    @property
    def port(self) -> int:
        return self.addresses[0][1]

    @classmethod
    def parse(cls, url: str) -> StreamEndpoint:
        """``rabbitmq-stream://user:pass@host:port[,host:port...]/vhost`` (port 5552, vhost
        ``/`` by default): a cluster's nodes, as the AMQP URL lists them."""
        parts = urlsplit(url)
        if parts.scheme != "rabbitmq-stream":
            raise ValueError(f"a stream URL starts rabbitmq-stream://, got {parts.scheme!r}")
        auth, _, hosts = parts.netloc.rpartition("@")
        user, _, password = auth.partition(":")
        addresses = []
        for item in hosts.split(","):
            host, port = item, "5552"
            if item.startswith("["):  # [IPv6]:port
                host, _, rest = item[1:].partition("]")
                port = rest.removeprefix(":") or "5552"
            elif item.count(":") == 1:
                host, port = item.split(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"a stream URL names host:port pairs, got {item!r}")
            addresses.append((host, int(port)))
        vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        return cls(
            addresses=tuple(addresses),
            username=unquote(user or "guest"),
            password=unquote(password or "guest"),
            vhost=vhost,
        )


def stream_url_of(settings: Settings) -> str:
    """The stream URL: ``stream_url``, else the AMQP URL's host, user and vhost on port 5552."""
    if settings.stream_url is not None:
        return settings.stream_url.get_secret_value()
    parts = urlsplit(settings.amqp_url.get_secret_value().split(",")[0])
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return f"rabbitmq-stream://{auth}{parts.hostname or '127.0.0.1'}:5552{parts.path or '/'}"
