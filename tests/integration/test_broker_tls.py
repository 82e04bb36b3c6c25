"""Broker connections as operators run them, against a real RabbitMQ TLS listener.

The module starts a RabbitMQ node of its own (``deploy/local/services.sh`` on free ports, data in a
temporary directory) with a TLS listener whose certificates ``openssl`` makes here: a CA, a server
certificate for ``localhost``/``127.0.0.1``, a client certificate (CN ``outbox-client``) and a
second, unrelated CA. Verification is on by default: the right CA connects, a wrong CA or a wrong
host name is refused with a clear error; EXTERNAL logs in as the client certificate's CN, and a
certificate of another CA is refused with a TLSError; a dead first host fails over to the next,
each failure logged; the publisher drains through such a URL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from app.amqp.connection import AMQPConnection, WireListener
from app.amqp.errors import BrokerUnreachableError, HandshakeError, TLSError
from app.db import make_engine
from app.outbox.store import PublisherStore
from app.publisher.engine import Publisher
from app.settings import Settings
from tests.support.env import SERVICES, scrubbed_environ
from tests.support.factories import add_rows
from tests.support.publisher import consume_ids, declare, delete, rows, run_until_empty
from tests.support.publisher import settings_for as publisher_settings
from tests.support.tls import CLIENT_CN, make_certificates


@dataclass(frozen=True)
class TLSBroker:
    amqp_port: int
    amqps_port: int
    certs: Path
    env: dict[str, str] = field(default_factory=dict, repr=False)  # services.sh's, for ctl

    def ctl(self, *args: str) -> str:
        """``rabbitmqctl`` on this node."""
        done = subprocess.run(
            [str(SERVICES), "ctl", "-q", *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout

    def url(self, query: str = "", *, hosts: str | None = None, auth: str = "guest:guest@") -> str:
        where = hosts or f"localhost:{self.amqps_port}"
        return f"amqps://{auth}{where}/" + (f"?{query}" if query else "")

    @property
    def plain_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def ca(self) -> str:
        return str(self.certs / "ca.pem")


def _free_port() -> int:
    """A free port whose distribution port (+20000) is free too."""
    for _ in range(100):
        port = random.randint(30000, 40000)
        try:
            for p in (port, port + 1, port + 20000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSBroker]:
    base = tmp_path_factory.mktemp("tls-broker")
    certs = base / "certs"
    certs.mkdir()
    make_certificates(certs)
    port = _free_port()
    env = scrubbed_environ(os.environ)
    env.update(
        OUTBOX_LOCAL_DIR=str(base / "local"),
        OUTBOX_LOCAL_AMQP_PORT=str(port),
        OUTBOX_LOCAL_AMQPS_PORT=str(port + 1),
        OUTBOX_LOCAL_TLS_DIR=str(certs),
    )

    def services(*args: str) -> None:
        subprocess.run(
            [str(SERVICES), *args], env=env, check=True, capture_output=True, timeout=180
        )

    services("start", "rabbitmq")
    try:
        services("ctl", "add_user", CLIENT_CN, uuid.uuid4().hex)
        services("ctl", "clear_password", CLIENT_CN)
        services("ctl", "set_permissions", "-p", "/", CLIENT_CN, ".*", ".*", ".*")
        yield TLSBroker(amqp_port=port, amqps_port=port + 1, certs=certs, env=env)
    finally:
        services("stop", "rabbitmq")


class _Quiet(WireListener):
    """A listener that ignores the broker: these tests only connect."""

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None: ...
    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None: ...
    def on_return(self, channel_id: int, message: object) -> None: ...  # type: ignore[override]
    def on_channel_closed(self, channel_id: int, reason: object) -> None: ...  # type: ignore[override]
    def on_blocked(self, reason: str) -> None: ...
    def on_unblocked(self) -> None: ...
    def on_connection_lost(self, reason: object) -> None: ...  # type: ignore[override]


async def _connect(url: str) -> AMQPConnection:
    return await AMQPConnection.connect(url, listener=_Quiet(), timeout=10)


async def test_the_right_ca_connects_and_a_drain_is_confirmed(
    tls_broker: TLSBroker, sqlite_url: str
) -> None:
    exchange = f"test-tls-{uuid.uuid4().hex[:8]}"
    await declare(tls_broker.plain_url, exchange=exchange, queue=exchange)
    engine = make_engine(sqlite_url)
    try:
        ids = add_rows(engine, n=50, exchange=exchange)
        url = tls_broker.url(f"cafile={tls_broker.ca}")
        await asyncio.wait_for(
            run_until_empty(publisher_settings(db_url=sqlite_url, amqp_url=url), engine), 60
        )
        assert {r.status for r in rows(engine)} == {"confirmed"}
        seen = await consume_ids(tls_broker.plain_url, exchange, expect=50)
        assert set(seen) == set(ids)
    finally:
        engine.dispose()
        await delete(tls_broker.plain_url, exchanges=(exchange,), queues=(exchange,))


async def test_a_wrong_ca_is_refused_with_a_clear_error(tls_broker: TLSBroker) -> None:
    url = tls_broker.url(f"cafile={tls_broker.certs / 'other-ca.pem'}")
    with pytest.raises(
        BrokerUnreachableError, match=r"TLS certificate not trusted: .*other-ca\.pem"
    ):
        await _connect(url)


async def test_the_system_cas_do_not_trust_a_private_ca(tls_broker: TLSBroker) -> None:
    """Verification is on by default: no cafile means the system's CAs, which refuse."""
    with pytest.raises(BrokerUnreachableError, match=r"not trusted: .*the system store"):
        await _connect(tls_broker.url())


async def test_a_wrong_host_name_is_refused(tls_broker: TLSBroker) -> None:
    url = tls_broker.url(f"cafile={tls_broker.ca}&server_hostname=broker.example.com")
    with pytest.raises(
        BrokerUnreachableError, match=r"not trusted: [Hh]ostname mismatch.*broker\.example\.com"
    ):
        await _connect(url)


async def test_no_verify_ssl_is_an_explicit_opt_out(tls_broker: TLSBroker) -> None:
    conn = await _connect(tls_broker.url("no_verify_ssl=1"))
    conn.abort()


async def test_external_auth_with_a_client_certificate(tls_broker: TLSBroker) -> None:
    certs = tls_broker.certs
    query = (
        f"cafile={tls_broker.ca}&certfile={certs / 'client.pem'}"
        f"&keyfile={certs / 'client.key'}&auth=external"
    )
    conn = await _connect(tls_broker.url(query, auth=""))
    try:
        assert await conn.open_channel() >= 1
    finally:
        conn.abort()
    # EXTERNAL needs a certificate; without one the URL itself is refused
    with pytest.raises(ValueError, match="auth=external needs"):
        await _connect(tls_broker.url(f"cafile={tls_broker.ca}&auth=external", auth=""))


async def test_external_auth_is_refused_by_a_broker_without_it(tls_broker: TLSBroker) -> None:
    """The plain listener offers only PLAIN: the error says what to enable."""
    certs = tls_broker.certs
    with pytest.raises((HandshakeError, BrokerUnreachableError)):
        await _connect(
            tls_broker.url(
                f"cafile={tls_broker.ca}&certfile={certs / 'client.pem'}"
                f"&keyfile={certs / 'client.key'}&auth=external",
                hosts=f"127.0.0.1:{tls_broker.amqp_port}",
                auth="",
            )
        )


async def test_a_dead_first_host_fails_over_to_the_next(tls_broker: TLSBroker) -> None:
    dead = _free_port()
    url = tls_broker.url(
        f"cafile={tls_broker.ca}", hosts=f"localhost:{dead},localhost:{tls_broker.amqps_port}"
    )
    conn = await _connect(url)
    conn.abort()
    with pytest.raises(BrokerUnreachableError, match=rf"localhost:{dead}: .*; localhost:"):
        await _connect(
            tls_broker.url(
                f"cafile={tls_broker.ca}", hosts=f"localhost:{dead},localhost:{dead + 1}"
            )
        )


def test_unsupported_or_unusable_url_options_are_errors(tls_broker: TLSBroker) -> None:
    bad = {
        "amqps://h/?heartbeat=5": "'heartbeat' is not supported",
        "amqp://h/?cafile=/etc/hosts": "need an amqps:// URL",
        "amqps://h/?cafile=/no/such/file": "not a readable file",
        "amqps://h/?no_verify_ssl=yes": "no_verify_ssl must be 0 or 1",
        "amqps://h/?auth=scram": "auth='scram' is not supported",
        f"amqps://h/?keyfile={tls_broker.certs / 'client.key'}": "keyfile without certfile",
        "amqps://h/?cafile=a&cafile=b": "given twice",
    }
    for url, message in bad.items():
        with pytest.raises(ValueError, match=message):
            Settings(amqp_url=url)  # type: ignore[arg-type]


def _listening(port: int) -> set[str]:
    """Local addresses listening on ``port`` (IPv4, from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_the_local_broker_listens_on_loopback_only(tls_broker: TLSBroker) -> None:
    """AMQP, AMQPS and the Erlang distribution port of a services.sh node: 127.0.0.1 only."""
    for port in (tls_broker.amqp_port, tls_broker.amqps_port, tls_broker.amqp_port + 20000):
        assert _listening(port) == {"127.0.0.1"}, port


# ---------------------------------------------------------------- who is connected, what is logged


def _connections(broker: TLSBroker) -> set[tuple[str, ...]]:
    """(user, auth_mechanism, ssl) of each client connection the node has now."""
    out = broker.ctl("list_connections", "user", "auth_mechanism", "ssl", "--no-table-headers")
    return {tuple(line.split("\t")) for line in out.splitlines() if line.strip()}


def _external_url(broker: TLSBroker, name: str) -> str:
    certs = broker.certs
    return broker.url(
        f"cafile={broker.ca}&certfile={certs / f'{name}.pem'}"
        f"&keyfile={certs / f'{name}.key'}&auth=external",
        auth="",
    )


async def test_external_logs_in_as_the_certificates_common_name(tls_broker: TLSBroker) -> None:
    conn = await _connect(_external_url(tls_broker, "client"))
    try:
        assert (CLIENT_CN, "EXTERNAL", "true") in _connections(tls_broker)
    finally:
        await conn.close()
    plain = await _connect(tls_broker.url(f"cafile={tls_broker.ca}"))
    try:
        assert ("guest", "PLAIN", "true") in _connections(tls_broker)
    finally:
        await plain.close()


async def test_a_client_certificate_of_another_ca_is_refused_with_a_tls_error(
    tls_broker: TLSBroker,
) -> None:
    """The broker refuses our certificate after the TLS 1.3 handshake: as an alert, or a reset
    when the socket goes first. Either way a TLSError that says so (tried a few times, since
    which of the two comes first is a race)."""
    said = r"refused the TLS session: .*UNKNOWN_CA|may have refused our client certificate"
    for _ in range(5):
        with pytest.raises(TLSError, match=said):
            await _connect(_external_url(tls_broker, "stranger"))


async def test_failover_logs_each_broker_that_failed(
    tls_broker: TLSBroker, caplog: pytest.LogCaptureFixture
) -> None:
    dead = _free_port()
    hosts = f"localhost:{dead},127.0.0.1:{tls_broker.amqps_port},localhost:{tls_broker.amqps_port}"
    url = tls_broker.url(f"cafile={tls_broker.ca}&server_hostname=localhost", hosts=hosts)
    with caplog.at_level(logging.INFO, logger="app.amqp.connection"):
        conn = await _connect(url)
    try:
        assert conn.address == ("127.0.0.1", tls_broker.amqps_port)
    finally:
        await conn.close()
    assert f"broker 1 of 3 failed, trying the next: localhost:{dead}: " in caplog.text
    assert f"connected to broker 127.0.0.1:{tls_broker.amqps_port} after 1 other(s)" in caplog.text


class _InOrder(random.Random):
    """A publisher's random source that leaves a URL's brokers in the order given (the
    publisher shuffles them so that publishers spread over a cluster's nodes)."""

    def shuffle(self, x: Any) -> None:
        del x


async def test_the_publisher_drains_through_a_failover_tls_url(
    tls_broker: TLSBroker, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The real publisher given a host list whose first broker is dead: every row confirmed and
    delivered once; the failover is in the log, the password is not."""
    queue = f"test-tls-{uuid.uuid4().hex[:8]}"
    await declare(tls_broker.plain_url, queue=queue)
    engine = make_engine(sqlite_url)
    try:
        ids = add_rows(engine, n=200, exchange="", routing_key=queue)
        hosts = f"localhost:{_free_port()},localhost:{tls_broker.amqps_port}"
        url = tls_broker.url(f"cafile={tls_broker.ca}", hosts=hosts)
        settings = publisher_settings(db_url=sqlite_url, amqp_url=url)
        # the URL's order, not a shuffled one: the dead broker is tried first, every time
        publisher = Publisher(settings=settings, store=PublisherStore(engine), rng=_InOrder())
        with caplog.at_level(logging.INFO):
            await asyncio.wait_for(publisher.run(until_empty=True), 60)
        assert {r.status for r in rows(engine)} == {"confirmed"} and len(rows(engine)) == 200
        seen = await consume_ids(tls_broker.plain_url, queue, expect=200, idle=0.3)
        assert set(seen) == set(ids) and set(seen.values()) == {1}
    finally:
        engine.dispose()
        await delete(tls_broker.plain_url, queues=(queue,))
    assert "broker 1 of 2 failed, trying the next" in caplog.text
    assert "guest:guest@" not in caplog.text
