"""Reading a stream with the inbox (app/consumer/streams.py) on the real broker and PostgreSQL:
the stream is written by the real publisher (outbox rows -> rabbitmq_stream); each message's
effect (a row in ``consumer_effects``, no unique key) happens exactly once through a consumer
killed with -9 and restarted, a position stored behind what was done, a handler that fails and
succeeds later (the consumer does not move past it), and one that always fails (given up at the
delivery limit, kept in ``outbox_consumer_attempts``, skipped, not run again when re-read)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rstream.client import Client
from sqlalchemy import Connection, Engine, select, text

from app.consumer import ConsumerConfig, Message, StreamConsumer, consumer_engine
from app.consumer import streams as stream_module
from app.outbox.enqueue import enqueue
from app.outbox.message import Message as OutboxMessage
from app.outbox.schema import consumer_attempts, inbox
from app.publisher.service import run_publisher
from app.streams.endpoint import StreamEndpoint
from tests.support.consumer import create_effects, effects, record
from tests.support.env import scrubbed_environ
from tests.support.publisher import settings_for
from tests.support.streams import delete_stream, new_stream

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    eng = consumer_engine(pg_url, concurrency=1)
    create_effects(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def stream(stream_url: str) -> Iterator[str]:
    name = new_stream(stream_url, prefix="test-stream-consumer")
    yield name
    delete_stream(stream_url, name)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_module, "RETRY_DELAY", 0.02)


def _publish(
    engine: Engine,
    urls: tuple[str, str, str],
    stream: str,
    n: int,
    headers: Callable[[int], dict[str, object]] = lambda i: {},
) -> list[str]:
    """``n`` rows for ``stream`` through the real publisher; their ids, in stream order."""
    pg_url, amqp_url, stream_url = urls
    rows = [
        OutboxMessage(stream=stream, body=b"x", message_id=f"m{i}", headers=headers(i) or None)
        for i in range(n)
    ]
    with engine.begin() as conn:
        enqueue(conn, rows)
    settings = settings_for(db_url=pg_url, amqp_url=amqp_url, stream_url=stream_url)
    asyncio.run(run_publisher(settings, until_empty=True))
    return [r.message_id for r in rows]


@pytest.fixture
def urls(pg_url: str, amqp_url: str, stream_url: str) -> tuple[str, str, str]:
    return pg_url, amqp_url, stream_url


async def _stored(stream_url: str, stream: str, name: str) -> int | None:
    """The offset the broker keeps under ``name`` (None: none stored)."""
    from rstream.exceptions import OffsetNotFound

    ep = StreamEndpoint.parse(stream_url)
    client = Client(host=ep.host, port=ep.port, frame_max=1024 * 1024, heartbeat=60)
    await client.start()
    try:
        await client.authenticate(vhost=ep.vhost, username=ep.username, password=ep.password)
        try:
            return int(await client.query_offset(stream, name))
        except OffsetNotFound:
            return None
    finally:
        await client.close()


async def _store(stream_url: str, stream: str, name: str, offset: int) -> None:
    ep = StreamEndpoint.parse(stream_url)
    client = Client(host=ep.host, port=ep.port, frame_max=1024 * 1024, heartbeat=60)
    await client.start()
    try:
        await client.authenticate(vhost=ep.vhost, username=ep.username, password=ep.password)
        await client.store_offset(stream=stream, reference=name, offset=offset)
        for _ in range(50):  # store_offset has no reply: wait until it reads back
            if await client.query_offset(stream, name) == offset:
                return
            await asyncio.sleep(0.05)
    finally:
        await client.close()


def _consume(consumer: StreamConsumer, done: Callable[[], bool], *, timeout: float = 30.0) -> None:
    """Run ``consumer`` in-process until ``done()``, then stop it as SIGTERM would."""

    async def go() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(done):
            assert not task.done(), task.exception()
            assert time.monotonic() < deadline, "the consumer did not get there in time"
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 15)

    asyncio.run(go())


def _exactly_once(engine: Engine, expected: list[str]) -> list[str]:
    got = effects(engine)
    counts = collections.Counter(got)
    assert {m: c for m, c in counts.items() if c > 1} == {}
    assert set(got) == set(expected)
    return got


def _in_order(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(text("SELECT message_id FROM consumer_effects ORDER BY n")).scalars()
        )


# ------------------------------------------------------------------------- crash and re-read


def _spawn(urls: tuple[str, str, str], stream: str, log: Path) -> subprocess.Popen[bytes]:
    pg_url, amqp_url, stream_url = urls
    env = scrubbed_environ(os.environ)
    env.update(
        OUTBOX_DATABASE_URL=pg_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_STREAM_URL=stream_url,
        PYTHONPATH=str(REPO),
    )
    argv = ["consume", "--stream", stream, "--handler", "tests.support.consumer:record"]
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli", *argv, "--name", "killed", "--batch-size", "50"],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 40
    while not check():
        assert proc.poll() is None, f"the consumer exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: {log.read_text()[-3000:]}"
        time.sleep(0.05)


def test_a_consumer_killed_mid_stream_resumes_and_every_effect_happens_once(
    engine: Engine, urls: tuple[str, str, str], stream: str, tmp_path: Path
) -> None:
    """2000 messages, each handler 2 ms: kill -9 with part done, start again: every effect
    exactly once, and the stored offset at the last message."""
    expected = _publish(engine, urls, stream, 2000, headers=lambda i: {"sleep_ms": 2})
    log = tmp_path / "consume.log"
    first = _spawn(urls, stream, log)
    try:
        _wait("first effects", lambda: len(effects(engine)) >= 600, first, log)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    done_at_kill = len(effects(engine))
    stored_at_kill = asyncio.run(_stored(urls[2], stream, "killed"))
    assert 600 <= done_at_kill < 2000, "kill -9 came too late to be mid-stream"
    assert stored_at_kill is None or stored_at_kill < done_at_kill  # after the commits only
    second = _spawn(urls, stream, log)
    try:
        _wait("all effects", lambda: len(effects(engine)) >= 2000, second, log)
        _wait(
            "the position stored",
            lambda: asyncio.run(_stored(urls[2], stream, "killed")) == 1999,
            second,
            log,
        )
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(20) == 0, log.read_text()[-3000:]
    time.sleep(0.5)  # a second effect of a re-read message would have shown by now
    _exactly_once(engine, expected)
    assert _in_order(engine)[:10] == expected[:10]


def test_a_position_stored_behind_the_effects_rereads_and_the_inbox_skips(
    engine: Engine, urls: tuple[str, str, str], stream: str
) -> None:
    """What a crash leaves (effects committed, the position stored before them), made exact:
    the consumer re-reads from the stored offset, and the inbox skips every re-read message."""
    stream_url = urls[2]
    expected = _publish(engine, urls, stream, 600)
    config = ConsumerConfig(name="behind", queue=stream, batch_size=100)

    def consumer() -> StreamConsumer:
        return StreamConsumer(config=config, stream_url=stream_url, engine=engine, handler=record)

    _consume(consumer(), lambda: len(effects(engine)) >= 600)
    assert asyncio.run(_stored(stream_url, stream, "behind")) == 599  # stored at the stop
    asyncio.run(_store(stream_url, stream, "behind", 99))
    again = consumer()
    _consume(again, lambda: again.next_offset == 600)
    assert again.metrics.counts["deduplicated"] == 500  # offsets 100-599 read again, skipped
    assert again.metrics.counts["handled"] == 0
    assert asyncio.run(_stored(stream_url, stream, "behind")) == 599
    _exactly_once(engine, expected)


# ------------------------------------------------------------------------- failing handlers


def test_a_failing_handler_holds_the_stream_at_its_message_until_it_succeeds(
    engine: Engine, urls: tuple[str, str, str], stream: str
) -> None:
    expected = _publish(engine, urls, stream, 300)
    calls: collections.Counter[str] = collections.Counter()

    def flaky(message: Message, conn: Connection) -> None:
        calls[message.message_id] += 1
        if message.message_id == "m150" and calls["m150"] <= 2:
            raise RuntimeError("not yet")
        record(message, conn)

    config = ConsumerConfig(name="flaky", queue=stream, batch_size=100, delivery_limit=5)
    consumer = StreamConsumer(config=config, stream_url=urls[2], engine=engine, handler=flaky)
    _consume(consumer, lambda: len(effects(engine)) >= 300)
    assert calls["m150"] == 3  # two failures, then its effect
    assert _in_order(engine) == expected  # nothing after it went first: the stream is ordered
    _exactly_once(engine, expected)
    assert consumer.metrics.counts["requeued"] == 2
    with engine.connect() as conn:  # its attempts are forgotten with its effect
        assert conn.execute(select(consumer_attempts)).all() == []


def test_a_message_that_keeps_failing_is_given_up_kept_and_not_run_again(
    engine: Engine, urls: tuple[str, str, str], stream: str, caplog: pytest.LogCaptureFixture
) -> None:
    expected = _publish(
        engine, urls, stream, 200, headers=lambda i: {"poison": True} if i == 70 else {}
    )
    calls: collections.Counter[str] = collections.Counter()

    def counted(message: Message, conn: Connection) -> None:
        calls[message.message_id] += 1
        record(message, conn)

    config = ConsumerConfig(name="poisoned", queue=stream, batch_size=50, delivery_limit=3)

    def consumer() -> StreamConsumer:
        return StreamConsumer(config=config, stream_url=urls[2], engine=engine, handler=counted)

    with caplog.at_level(logging.WARNING, logger="app.consumer"):
        first = consumer()
        _consume(first, lambda: first.next_offset == 200)
    assert calls["m70"] == 3  # the delivery limit: then it is given up and skipped
    assert first.metrics.counts["dead_lettered"] == 1
    gave_up = [r for r in caplog.records if "gives up m70" in r.getMessage()]
    assert gave_up and gave_up[0].levelno == logging.ERROR
    assert "delivery limit 3 reached" in gave_up[0].getMessage()
    _exactly_once(engine, [m for m in expected if m != "m70"])
    with engine.connect() as conn:
        kept = conn.execute(select(consumer_attempts)).one()
        assert (
            conn.execute(select(inbox.c.message_id).where(inbox.c.message_id == "m70")).all() == []
        )
    assert (kept.consumer, kept.message_id, kept.attempts) == ("poisoned", "m70", 3)
    assert "delivery limit 3 reached" in kept.last_error
    assert "ValueError: cannot process m70" in kept.last_error
    assert asyncio.run(_stored(urls[2], stream, "poisoned")) == 199  # moved past it
    # read again from before it (a crash before the position was stored): not run again
    asyncio.run(_store(urls[2], stream, "poisoned", 9))
    again = consumer()
    _consume(again, lambda: again.next_offset == 200)
    assert calls["m70"] == 3 and again.metrics.counts["dead_lettered"] == 1
    assert again.metrics.counts["handled"] == 0
    _exactly_once(engine, [m for m in expected if m != "m70"])
    with engine.connect() as conn:
        assert conn.execute(select(consumer_attempts.c.attempts)).scalar_one() == 3
