"""AMQP URLs, pure: host lists for failover, TLS options, EXTERNAL auth; every option this client
does not implement, and every one it would silently not use, is an error naming it."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from app.amqp.params import TLSOptions, URLError, parse_url
from app.logs import redact_url


@pytest.fixture
def pem(tmp_path: Path) -> str:
    """A file standing for a CA or certificate (parse_url checks that the files exist)."""
    path = tmp_path / "x.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


def test_defaults() -> None:
    p = parse_url("amqp://broker")
    assert (p.host, p.port, p.vhost, p.username, p.password, p.tls, p.auth) == (
        "broker",
        5672,
        "/",
        "guest",
        "guest",
        False,
        "plain",
    )
    assert p.addresses == (("broker", 5672),)
    assert (parse_url("amqps://broker").port, parse_url("amqps://broker").tls) == (5671, True)
    assert parse_url("amqps://broker").ssl_context() is not None
    assert parse_url("amqp://broker").ssl_context() is None


def test_host_list_in_order_each_with_its_port() -> None:
    p = parse_url("amqps://u:p@rmq-1:5671, rmq-2 ,[::1]:6000/prod")
    assert p.addresses == (("rmq-1", 5671), ("rmq-2", 5671), ("::1", 6000))
    assert (p.host, p.port, p.vhost) == ("rmq-1", 5671, "prod")
    assert [p.server_hostname(h) for h, _ in p.addresses] == ["rmq-1", "rmq-2", "::1"]


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("amqp://a,,b/", "names no broker host"),
        ("amqp://a:99999/", "port '99999' of host 'a' is not a port number"),
        ("amqp://a:port/", "port 'port' of host 'a'"),
        ("amqp://a:0/", "port '0'"),
    ],
)
def test_bad_host_lists(url: str, error: str) -> None:
    with pytest.raises(URLError, match=error):
        parse_url(url)


def test_credentials_with_reserved_characters() -> None:
    p = parse_url("amqp://u:p%40ss%2Cw@h/")
    assert (p.username, p.password) == ("u", "p@ss,w")
    assert "p@ss" not in repr(p)
    # unescaped "@" and "/" in the password: the hosts start after the LAST "@"
    raw = parse_url("amqp://u:pa@s/s@h:5673/vh")
    assert (raw.password, raw.addresses, raw.vhost) == ("pa@s/s", (("h", 5673),), "vh")


def test_an_error_about_the_hosts_never_quotes_the_password() -> None:
    with pytest.raises(URLError) as caught:
        parse_url("amqp://u:hunt/er2@h:bad/")
    assert "hunt" not in str(caught.value) and "er2" not in str(caught.value)


def test_vhost() -> None:
    assert parse_url("amqp://h/prod%2Fa").vhost == "prod/a"
    assert parse_url("amqp://h/").vhost == "/"
    assert parse_url("amqp://h").vhost == "/"


def test_tls_options(pem: str) -> None:
    p = parse_url(
        f"amqps://u:pw@10.0.0.5/?cafile={pem}&certfile={pem}&keyfile={pem}"
        "&server_hostname=rabbit.internal"
    )
    assert p.tls_options == TLSOptions(
        cafile=pem, certfile=pem, keyfile=pem, server_hostname="rabbit.internal", verify=True
    )
    assert p.server_hostname("10.0.0.5") == "rabbit.internal"


def test_verification_is_on_unless_turned_off() -> None:
    on = parse_url("amqps://h/")
    assert on.tls_options.verify
    context = on.ssl_context()
    assert context is not None and context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname
    off = parse_url("amqps://h/?no_verify_ssl=1")
    context = off.ssl_context()
    assert not off.tls_options.verify
    assert context is not None and context.verify_mode is ssl.CERT_NONE
    assert parse_url("amqps://h/?no_verify_ssl=0").tls_options == on.tls_options


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("verify=0", "URL option 'verify' is not supported \\(supported: cafile, capath"),
        ("heartbeat=30", "'heartbeat' is not supported"),
        ("cadata=AAAA", "'cadata' is not supported"),
        ("ssl_options=%7B%7D", "'ssl_options' is not supported"),
        ("server_hostname=a&server_hostname=b", "'server_hostname' is given twice"),
        ("server_hostname=", "'server_hostname' has no value"),
        ("cafile", "'cafile' has no value"),
        ("cafile=/no/such/ca.pem", "cafile '/no/such/ca.pem' is not a readable file"),
        ("capath=/no/such/dir", "capath '/no/such/dir' is not a directory"),
        ("no_verify_ssl=yes", "no_verify_ssl must be 0 or 1, not 'yes'"),
        ("auth=amqplain", "auth='amqplain' is not supported"),
    ],
)
def test_unsupported_or_unusable_options(query: str, error: str) -> None:
    with pytest.raises(URLError, match=error):
        parse_url(f"amqps://u:secret@h/?{query}")


def test_options_that_would_not_be_used_are_errors(pem: str) -> None:
    with pytest.raises(URLError, match="keyfile without certfile"):
        parse_url(f"amqps://h/?keyfile={pem}")
    with pytest.raises(URLError, match="the CA would never be checked"):
        parse_url(f"amqps://h/?no_verify_ssl=1&cafile={pem}")
    with pytest.raises(URLError, match="#fragment"):
        parse_url("amqp://h/vh#x")


@pytest.mark.parametrize("option", ["cafile=/etc/hosts", "server_hostname=x", "no_verify_ssl=1"])
def test_tls_options_need_amqps(option: str) -> None:
    with pytest.raises(URLError, match="need an amqps:// URL"):
        parse_url(f"amqp://h/?{option}")


def test_external_auth_takes_the_certificate_and_no_password(pem: str) -> None:
    p = parse_url(f"amqps://h/?certfile={pem}&auth=external")
    assert p.auth == "external"
    assert parse_url(f"amqps://outbox@h/?certfile={pem}&auth=EXTERNAL").auth == "external"
    with pytest.raises(URLError, match="auth=external needs amqps:// and a client certificate"):
        parse_url("amqps://h/?auth=external")
    with pytest.raises(URLError, match="auth=external needs amqps://"):
        parse_url("amqp://h/?auth=external")
    with pytest.raises(URLError, match="remove the password"):
        parse_url(f"amqps://u:pw@h/?certfile={pem}&auth=external")
    assert parse_url("amqp://h/?auth=plain").auth == "plain"


def test_other_schemes_are_refused() -> None:
    with pytest.raises(URLError, match="not an AMQP URL"):
        parse_url("http://h/")
    with pytest.raises(URLError, match="not an AMQP URL"):
        parse_url("localhost:5672")


def test_the_log_redactor_hides_the_password_of_a_host_list() -> None:
    redacted = redact_url("amqps://u:s3cret@a:1,b:2/vh?cafile=/ca.pem")
    assert "s3cret" not in redacted and "a:1,b:2/vh?cafile=/ca.pem" in redacted
