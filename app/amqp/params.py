"""Where and as whom to connect: ``amqp://`` and ``amqps://`` URLs parsed into parameters.

The URL takes the query options aiormq and pika users know, and nothing else: an option this
client does not implement is an error naming it, never silently ignored.

==================  ==========================================================================
option              meaning
==================  ==========================================================================
``cafile``          CA bundle (PEM) that signs the broker's certificate (default: the system's)
``capath``          directory of CA certificates (``c_rehash`` layout)
``certfile``        client certificate (PEM), for mutual TLS and ``auth=external``
``keyfile``         the client certificate's private key (PEM; default: inside ``certfile``)
``server_hostname`` the name the broker's certificate must carry (default: the URL's host)
``no_verify_ssl``   ``1`` turns certificate *and* host name verification off (never in
                    production: anyone on the path can pose as the broker); default ``0``
``auth``            ``plain`` (user and password, the default) or ``external`` (the client
                    certificate is the identity; RabbitMQ's ``rabbitmq_auth_mechanism_ssl``)
==================  ==========================================================================

Several brokers for failover: ``amqps://user:pass@host1:5671,host2:5671,host3/vhost``. The
publisher tries them in order on every (re)connect and uses the first that answers.
"""

from __future__ import annotations

import platform
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from pamqp import commands, common

DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}
OPTIONS = ("cafile", "capath", "certfile", "keyfile", "server_hostname", "no_verify_ssl", "auth")
AUTH_MECHANISMS = ("plain", "external")


class URLError(ValueError):
    """The broker URL cannot be used as given (the message says what to change)."""


@dataclass(frozen=True, slots=True)
class TLSOptions:
    cafile: str | None = None
    capath: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    server_hostname: str | None = None
    verify: bool = True

    def context(self) -> ssl.SSLContext:
        """A client context: TLS 1.2+, the CA given (or the system's), verification on unless
        ``no_verify_ssl=1``, and the client certificate when given."""
        ctx = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=self.cafile, capath=self.capath
        )
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.certfile:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        return ctx


@dataclass(frozen=True, slots=True)
class AMQPParams:
    """Where and as whom to connect, parsed from an ``amqp://`` or ``amqps://`` URL."""

    host: str
    port: int
    vhost: str
    username: str
    password: str = field(repr=False)
    tls: bool = False
    #: every broker to try, in order (``host``/``port`` are the first)
    hosts: tuple[tuple[str, int], ...] = ()
    tls_options: TLSOptions = field(default_factory=TLSOptions)
    auth: str = "plain"

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return self.hosts or ((self.host, self.port),)

    def ssl_context(self) -> ssl.SSLContext | None:
        return self.tls_options.context() if self.tls else None

    def server_hostname(self, host: str) -> str | None:
        """The name the certificate must carry when connecting to ``host`` (TLS only)."""
        if not self.tls:
            return None
        return self.tls_options.server_hostname or host


def parse_url(url: str) -> AMQPParams:
    """``amqp[s]://user:pass@host[:port][,host2[:port]...]/vhost?options`` ->
    :class:`AMQPParams` (vhost ``/`` by default). Raises :class:`URLError`."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS:
        raise URLError(f"not an AMQP URL (scheme {parts.scheme!r}; use amqp:// or amqps://)")
    if parts.fragment or url.endswith("#"):
        raise URLError("an AMQP URL has no #fragment (percent-encode a '#' in the password)")
    tls = parts.scheme == "amqps"
    netloc, path = _netloc_and_path(url)
    userinfo, _, hostlist = netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    hosts = tuple(_host(h, DEFAULT_PORTS[parts.scheme]) for h in hostlist.split(","))
    options = _options(parts.query, tls=tls)
    auth = options.pop("auth", "plain").lower()
    if auth not in AUTH_MECHANISMS:
        raise URLError(f"auth={auth!r} is not supported; use one of {', '.join(AUTH_MECHANISMS)}")
    tls_options = _tls_options(options) if tls else TLSOptions()
    if auth == "external" and not (tls and tls_options.certfile):
        raise URLError("auth=external needs amqps:// and a client certificate (certfile=...)")
    if auth == "external" and password:
        raise URLError("auth=external logs in with the client certificate: remove the password")
    return AMQPParams(
        host=hosts[0][0],
        port=hosts[0][1],
        vhost=unquote(path) if path else "/",
        username=unquote(user) if userinfo else "guest",
        password=unquote(password) if userinfo else "guest",
        tls=tls,
        hosts=hosts,
        tls_options=tls_options,
        auth=auth,
    )


def _netloc_and_path(url: str) -> tuple[str, str]:
    """``user:pass@hosts`` and the vhost path (without its slash) of ``url``. The hosts start
    after the LAST ``@`` and end at the first ``/`` after it, so an unescaped ``/`` or ``@`` in
    the password is not taken for the path or a host (nor quoted in an error)."""
    rest = url.split("://", 1)[1].split("?", 1)[0].split("#", 1)[0]
    slash = rest.find("/", rest.rfind("@") + 1)
    return (rest, "") if slash < 0 else (rest[:slash], rest[slash + 1 :])


def _host(text: str, default_port: int) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [ipv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise URLError("the URL names no broker host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise URLError(f"port {port_text!r} of host {host!r} is not a port number")
    return host, int(port_text)


def _options(query: str, *, tls: bool) -> dict[str, str]:
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    seen: dict[str, str] = {}
    for key, value in pairs:
        if key not in OPTIONS:
            raise URLError(f"URL option {key!r} is not supported (supported: {', '.join(OPTIONS)})")
        if key in seen:
            raise URLError(f"URL option {key!r} is given twice")
        if not value:
            raise URLError(f"URL option {key!r} has no value")
        seen[key] = value
    tls_only = sorted(set(seen) - {"auth"})
    if tls_only and not tls:
        raise URLError(f"URL options {', '.join(tls_only)} need an amqps:// URL")
    return seen


def _tls_options(options: dict[str, str]) -> TLSOptions:
    for key in ("cafile", "certfile", "keyfile"):
        if key in options and not Path(options[key]).is_file():
            raise URLError(f"{key} {options[key]!r} is not a readable file")
    if "capath" in options and not Path(options["capath"]).is_dir():
        raise URLError(f"capath {options['capath']!r} is not a directory")
    if "keyfile" in options and "certfile" not in options:
        raise URLError("keyfile without certfile: give the client certificate too")
    flag = options.get("no_verify_ssl", "0")
    if flag not in ("0", "1"):
        raise URLError(f"no_verify_ssl must be 0 or 1, not {flag!r}")
    if flag == "1" and ("cafile" in options or "capath" in options):
        raise URLError("no_verify_ssl=1 with cafile/capath: the CA would never be checked")
    return TLSOptions(
        cafile=options.get("cafile"),
        capath=options.get("capath"),
        certfile=options.get("certfile"),
        keyfile=options.get("keyfile"),
        server_hostname=options.get("server_hostname") or None,
        verify=flag == "0",
    )


def start_ok(params: AMQPParams, *, name: str) -> commands.Connection.StartOk:
    """The handshake's ``connection.start-ok``: our capabilities, and the login."""
    capabilities: common.FieldTable = {
        "publisher_confirms": True,
        "consumer_cancel_notify": True,
        "connection.blocked": True,
        "authentication_failure_close": True,
        "basic.nack": True,
        "exchange_exchange_bindings": True,
    }
    client_properties: common.FieldTable = {
        "product": "outbox-publisher",
        "platform": f"Python {platform.python_version()}",
        "connection_name": name,
        "capabilities": capabilities,
        "information": "pamqp frame codec, batched publish path",
    }
    if params.auth == "external":  # the client certificate is the identity
        return commands.Connection.StartOk(client_properties, "EXTERNAL", "", "en_US")
    response = f"\0{params.username}\0{params.password}"
    return commands.Connection.StartOk(client_properties, "PLAIN", response, "en_US")
