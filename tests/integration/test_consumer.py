"""The consumer kit on the real broker and PostgreSQL: each message's effect happens once,
through redeliveries, duplicates, a consumer killed mid-batch, channels closed by the broker,
a poison message and a deleted queue."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from sqlalchemy import Engine

from app.consumer import Consumer, ConsumerConfig
from app.db import make_engine
from tests.support.consumer import (
    create_effects,
    declared_queue,
    effects,
    publish,
    record,
    running_consumer,
    until,
)
from tests.support.env import close_broker_connections, scrubbed_environ

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    eng = make_engine(pg_url)
    create_effects(eng)
    yield eng
    eng.dispose()


@pytest.fixture
async def queue(amqp_url: str) -> AsyncIterator[str]:
    """A durable queue dead-lettering into ``<name>.dlq``; both deleted afterwards."""
    async with declared_queue(amqp_url, prefix="test-consumer") as name:
        yield name


async def depth(amqp_url: str, queue: str) -> int:
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        q = await ch.declare_queue(queue, passive=True)
        return int(q.declaration_result.message_count or 0)


@contextlib.asynccontextmanager
async def consuming(
    amqp_url: str, engine: Engine, queue: str, **config: Any
) -> AsyncIterator[Consumer]:
    cfg = ConsumerConfig(name=config.pop("name", "test"), queue=queue, **config)
    async with running_consumer(amqp_url, engine, cfg, handler=record) as consumer:
        yield consumer


async def test_every_effect_once_with_prefetch_and_multiple_acks(
    amqp_url: str, engine: Engine, queue: str
) -> None:
    ids = [f"m-{i}" for i in range(500)]
    await publish(amqp_url, queue, ids)
    await publish(amqp_url, queue, ids[:50])  # duplicate publishes (a lost confirm upstream)
    async with consuming(amqp_url, engine, queue, prefetch=50, concurrency=4) as consumer:
        await until(lambda: consumer.metrics.counts["acked"] == 550, what="550 acks")
    got = effects(engine)
    assert sorted(got) == sorted(ids)  # one effect per message, none twice
    c = consumer.metrics.counts
    assert (c["handled"], c["deduplicated"]) == (500, 50)
    assert c["ack_frames"] < c["acked"]  # acks went out with multiple
    assert await depth(amqp_url, queue) == 0
    from prometheus_client import generate_latest

    from app.consumer import registry_for

    text = generate_latest(registry_for(consumer.metrics, consumer="test")).decode()
    assert 'outbox_consumer_handled_total{consumer="test"} 500.0' in text
    assert 'outbox_consumer_deduplicated_total{consumer="test"} 50.0' in text
    assert 'outbox_consumer_handler_seconds_count{consumer="test"} 550.0' in text


async def test_the_consumer_engine_keeps_one_session_per_handler_thread(
    pg_url: str, amqp_url: str, engine: Engine, queue: str
) -> None:
    """Eight handler threads at prefetch 10 on ``consumer_engine`` (what ``outbox consume``
    uses): eight database sessions in all. On the default pool of five, the threads beyond it
    opened and closed a session per message (about 300 for 2,000 messages in the benchmark)."""
    from sqlalchemy import event

    from app.consumer import consumer_engine

    ids = [f"s-{i}" for i in range(400)]
    await publish(amqp_url, queue, ids)
    sized = consumer_engine(pg_url, concurrency=8)
    sessions = []
    event.listen(sized, "connect", lambda *_: sessions.append(1))
    try:
        async with consuming(amqp_url, sized, queue, prefetch=10, concurrency=8) as consumer:
            await until(lambda: consumer.metrics.counts["acked"] == 400, what="400 acks")
    finally:
        sized.dispose()
    assert sorted(effects(engine)) == sorted(ids)
    assert len(sessions) <= 8, f"{len(sessions)} database sessions for 8 handler threads"


def test_a_pool_smaller_than_the_handler_threads_is_named_at_start(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from app.consumer import consumer_engine

    small, sized = make_engine(pg_url, pool_size=2), consumer_engine(pg_url, concurrency=4)
    config = ConsumerConfig(name="pooled", queue="unused", concurrency=4)
    try:
        with caplog.at_level(logging.WARNING, logger="app.consumer"):
            Consumer(config=config, amqp_url="amqp://127.0.0.1:9/", engine=small, handler=record)
            assert "keeps 2 connections for 4 handler threads" in caplog.text
            assert "pool_size >= 4" in caplog.text
            caplog.clear()
            Consumer(config=config, amqp_url="amqp://127.0.0.1:9/", engine=sized, handler=record)
            assert "handler threads" not in caplog.text
    finally:
        small.dispose()
        sized.dispose()


async def test_a_poison_message_is_dead_lettered_and_never_blocks_the_rest(
    amqp_url: str, engine: Engine, queue: str
) -> None:
    good = [f"g-{i}" for i in range(100)]
    await publish(amqp_url, queue, ["poison-1"], poison=True)
    await publish(amqp_url, queue, good)
    async with consuming(amqp_url, engine, queue, prefetch=20, delivery_limit=3) as consumer:
        await until(
            lambda: (
                consumer.metrics.counts["dead_lettered"] == 1
                and consumer.metrics.counts["handled"] == 100
            ),
            what="drain",
        )
    assert sorted(effects(engine)) == sorted(good)
    assert consumer.metrics.counts["requeued"] == 2  # tried 3 times in all
    assert await depth(amqp_url, f"{queue}.dlq") == 1


async def test_channels_closed_by_the_broker_mid_batch_lose_and_repeat_nothing(
    amqp_url: str, engine: Engine, queue: str
) -> None:
    ids = [f"c-{i}" for i in range(1500)]
    await publish(amqp_url, queue, ids, sleep_ms=1)
    name = f"close-{uuid.uuid4().hex[:8]}"
    async with consuming(amqp_url, engine, queue, prefetch=100, name=name) as consumer:
        for n in (300, 900):
            await until(lambda n=n: len(effects(engine)) >= n, what=f"{n} effects")
            closed = await asyncio.to_thread(close_broker_connections, f"outbox-consumer {name}")
            assert closed == 1
        await until(lambda: len(set(effects(engine))) == 1500, timeout=120, what="all effects")
    got = effects(engine)
    assert len(got) == 1500 and len(set(got)) == 1500
    assert consumer.metrics.counts["reconnects"] >= 2


async def test_a_deleted_queue_cancels_the_consumer_and_it_resumes_when_it_returns(
    amqp_url: str, engine: Engine, queue: str
) -> None:
    async with consuming(amqp_url, engine, queue) as consumer:
        await until(lambda: consumer.metrics.connected, what="consuming")
        conn = await aio_pika.connect(amqp_url)
        async with conn:
            await (await conn.channel()).queue_delete(queue)
        await until(lambda: consumer.metrics.counts["cancels"] == 1, what="the cancel")
        conn = await aio_pika.connect(amqp_url)
        async with conn:
            dlx = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{queue}.dlq"}
            await (await conn.channel()).declare_queue(queue, durable=True, arguments=dlx)
        await publish(amqp_url, queue, ["after-1"])
        await until(lambda: "after-1" in effects(engine), timeout=60, what="resumed")


def _spawn(pg_url: str, amqp_url: str, queue: str) -> subprocess.Popen[bytes]:
    env = scrubbed_environ(os.environ)
    env.update(OUTBOX_DATABASE_URL=pg_url, OUTBOX_AMQP_URL=amqp_url, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "consume",
            queue,
            "--handler",
            "tests.support.consumer:record",
            "--name",
            "killed",
            "--prefetch",
            "200",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def test_kill_9_mid_batch_then_restart_every_effect_exactly_once(
    pg_url: str, amqp_url: str, engine: Engine, queue: str
) -> None:
    ids = [f"k-{i}" for i in range(2000)]
    await publish(amqp_url, queue, ids, sleep_ms=1)
    first = _spawn(pg_url, amqp_url, queue)
    try:
        await until(lambda: len(effects(engine)) >= 600, timeout=90, what="600 effects")
        first.send_signal(signal.SIGKILL)  # effects committed, acks not all sent
        first.wait(timeout=30)
        second = _spawn(pg_url, amqp_url, queue)
        try:
            await until(lambda: len(set(effects(engine))) == 2000, timeout=120, what="every effect")
            await until(
                lambda: asyncio.run(depth(amqp_url, queue)) == 0, timeout=30, what="an empty queue"
            )
        finally:
            second.send_signal(signal.SIGTERM)
            _, err = second.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    got = collections.Counter(effects(engine))
    assert len(got) == 2000 and max(got.values()) == 1, got.most_common(3)
    assert b"Traceback" not in err, err[-2000:]


def test_the_inbox_runs_a_handler_once_and_rolls_back_with_it(db_url: str) -> None:
    """PostgreSQL and SQLite: the inbox row and the handler's writes commit together."""
    import datetime as dt

    from sqlalchemy import text

    from app.consumer import Message, handle_once, purge_inbox
    from app.consumer.inbox import seen

    eng = make_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(text("CREATE TABLE effects (message_id TEXT NOT NULL)"))

        def write(message: Message, conn: Any) -> None:
            conn.execute(text("INSERT INTO effects VALUES (:m)"), {"m": message.message_id})
            if message.headers.get("fail"):
                raise RuntimeError("handler failed after its write")

        m = Message(message_id="a", body=b"", routing_key="", exchange="")
        assert handle_once(eng, consumer="c", message=m, handler=write) is True
        assert handle_once(eng, consumer="c", message=m, handler=write) is False
        assert handle_once(eng, consumer="other", message=m, handler=write) is True  # per consumer
        bad = Message(message_id="b", body=b"", routing_key="", exchange="", headers={"fail": 1})
        with pytest.raises(RuntimeError):
            handle_once(eng, consumer="c", message=bad, handler=write)
        assert not seen(eng, consumer="c", message_id="b")  # rolled back with the handler
        with eng.connect() as conn:
            rows = conn.execute(text("SELECT message_id FROM effects")).scalars().all()
        assert sorted(rows) == ["a", "a"]
        assert purge_inbox(eng, older_than=dt.timedelta(seconds=-1)) == 2
    finally:
        eng.dispose()


async def test_a_producer_s_own_delivery_count_dead_letters_nothing(
    amqp_url: str, engine: Engine, queue: str
) -> None:
    """Issue 48: a message published (by anyone) with ``x-delivery-count: 999`` to a classic
    queue was dead-lettered on its first delivery without its handler running, logged as "the
    broker returned it 999 times". On a first delivery the header can only be the producer's:
    the handler runs, once."""
    await publish(amqp_url, queue, ["forged-1", "forged-2"], **{"x-delivery-count": 999})
    async with consuming(amqp_url, engine, queue, prefetch=10) as consumer:
        await until(lambda: consumer.metrics.counts["acked"] == 2, what="2 acks")
    assert sorted(effects(engine)) == ["forged-1", "forged-2"]
    assert consumer.metrics.counts["dead_lettered"] == 0
    assert await depth(amqp_url, queue + ".dlq") == 0
