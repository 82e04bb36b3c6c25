"""``outbox declare --stream`` against the real broker: a stream with its retention, declared
again with the same arguments (nothing changes), refused with others (exit 1, the broker's
``inequivalent arg``), and bad input refused before the broker is asked (exit 2)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import aio_pika
import pytest
from rstream.client import Client

from app.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from app.streams.endpoint import StreamEndpoint
from tests.support.cli import env, run
from tests.support.streams import delete_stream

__all__ = ["env"]  # the fixture, used by name
#: the commands need a database URL, not a database: the cheapest one
pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture
def broker(env: str, amqp_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OUTBOX_AMQP_URL", amqp_url)
    return amqp_url


@pytest.fixture
def name(stream_url: str) -> Iterator[str]:
    """A stream name of the test's own; the stream is deleted afterwards if it was made."""
    made = f"test-declare-stream-{uuid.uuid4().hex[:10]}"
    yield made
    if asyncio.run(_exists(stream_url, made)):
        delete_stream(stream_url, made)


async def _exists(url: str, stream: str) -> bool:
    """Whether ``stream`` is a stream the stream protocol finds (a classic queue is not)."""
    ep = StreamEndpoint.parse(url)
    client = Client(host=ep.host, port=ep.port, frame_max=1024 * 1024, heartbeat=60)
    await client.start()
    try:
        await client.authenticate(vhost=ep.vhost, username=ep.username, password=ep.password)
        return bool(await client.stream_exists(stream))
    finally:
        await client.close()


RETENTION = (
    "--max-length-bytes",
    "2GB",
    "--max-age",
    "7D",
    "--stream-max-segment-size-bytes",
    "100000000",
)


def test_declares_a_stream_with_its_retention_idempotently(
    broker: str, stream_url: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["declare", "--stream", name, *RETENTION, "--json"]
    rc, out, err = run(capsys, *argv)
    assert rc == EXIT_OK, err
    arguments = {
        "x-max-length-bytes": 2_000_000_000,
        "x-max-age": "7D",
        "x-stream-max-segment-size-bytes": 100_000_000,
    }
    assert json.loads(out) == {"streams": [{"stream": name, "arguments": arguments}]}
    assert asyncio.run(_exists(stream_url, name))
    rc, out, err = run(capsys, *argv[:-1])  # again, the same arguments: nothing changes
    assert rc == EXIT_OK, err
    assert out.strip() == (
        f"stream {name!r} (durable, x-max-length-bytes=2000000000, x-max-age=7D, "
        "x-stream-max-segment-size-bytes=100000000) is declared"
    )


@pytest.mark.parametrize(
    ("changed", "arg"),
    [
        (("--max-age", "24h"), "x-max-age"),
        (("--max-length-bytes", "1GB"), "x-max-length-bytes"),
        (("--stream-max-segment-size-bytes", "50MB"), "x-stream-max-segment-size-bytes"),
    ],
)
def test_other_arguments_for_an_existing_stream_are_the_brokers_refusal(
    broker: str,
    name: str,
    capsys: pytest.CaptureFixture[str],
    changed: tuple[str, str],
    arg: str,
) -> None:
    rc, _, err = run(capsys, "declare", "--stream", name, *RETENTION)
    assert rc == EXIT_OK, err
    given = dict(zip(RETENTION[::2], RETENTION[1::2], strict=True)) | dict([changed])
    flags = [x for kv in given.items() for x in kv]
    rc, out, err = run(capsys, "declare", "--stream", name, *flags)
    assert rc == EXIT_FAILURE and out == ""
    assert "the broker refused: 406 PRECONDITION_FAILED - inequivalent arg" in err, err
    assert f"'{arg}'" in err and "Traceback" not in err


def test_a_stream_and_an_exchange_in_one_run(
    broker: str, stream_url: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    exchange = f"{name}-x"
    try:
        rc, out, err = run(capsys, "declare", exchange, "--stream", name, "--max-age", "12h")
        assert rc == EXIT_OK, err
        assert out.splitlines() == [
            f"exchange {exchange!r} (topic, durable) is declared",
            f"stream {name!r} (durable, x-max-age=12h) is declared",
        ]
        assert asyncio.run(_exists(stream_url, name))
    finally:
        asyncio.run(_delete_exchange(broker, exchange))


async def _delete_exchange(url: str, exchange: str) -> None:
    conn = await aio_pika.connect(url)
    async with conn:
        ch = await conn.channel()
        await ch.exchange_delete(exchange)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--max-age", "7X"), "max-age '7X': expected a count and a unit"),
        (("--max-age", "0D"), "max-age '0D'"),
        (("--max-age", "7 days"), "max-age '7 days'"),
        (("--max-length-bytes", "0"), "max-length-bytes 0: expected 1 or more"),
        (("--stream-max-segment-size-bytes", "4GB"), "expected 1 to 3000000000"),
        (("--initial-cluster-size", "0"), "initial cluster size 0"),
    ],
)
def test_invalid_retention_is_refused_before_the_broker_is_asked(
    broker: str,
    stream_url: str,
    name: str,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    says: str,
) -> None:
    rc, out, err = run(capsys, "declare", "--stream", name, *argv)
    assert rc == EXIT_USAGE and out == "" and says in err, err
    assert not asyncio.run(_exists(stream_url, name))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--max-age", "7D"), "are a --stream's"),
        ((), "name an EXCHANGE, or a --stream, or both"),
        (("--stream", "s", "--queue", "q"), "--queue and --bind need an EXCHANGE"),
    ],
)
def test_flags_without_what_they_belong_to_are_usage_errors(
    broker: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], says: str
) -> None:
    rc, _, err = run(capsys, "declare", *argv)
    assert rc == EXIT_USAGE and says in err, err


def test_a_size_that_is_not_one_is_an_argument_error(
    broker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        run(capsys, "declare", "--stream", "s", "--max-length-bytes", "lots")
    assert exited.value.code == EXIT_USAGE
    assert "'lots' is not a size" in capsys.readouterr().err
