"""The consumer kit against its own dependencies failing for real: its PostgreSQL refusing
connections or its TCP connections cut for seconds, a handler that kills the process (on a
classic and on a quorum queue), a slow handler, a hung one; and all of kill -9, a database
outage and a broker connection close in one run. Each test counts effects per message id: one
for every good message, none for poison, and the dead-letter queue holds exactly the poison."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import pytest
from sqlalchemy import Engine

from app.consumer import Consumer, ConsumerConfig, consumer_engine
from app.db import make_engine
from chaos.proxy import TcpProxy
from tests.support.consumer import (
    create_effects,
    declared_queue,
    effects,
    publish,
    record,
    until,
)
from tests.support.env import close_broker_connections, scrubbed_environ
from tests.support.pgfaults import database_refusing

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    eng = make_engine(pg_url)
    create_effects(eng)
    yield eng
    eng.dispose()


def queue_named(amqp_url: str, *, quorum: bool = False) -> Any:
    return declared_queue(amqp_url, prefix="test-faults", quorum=quorum)


async def dead_letters(amqp_url: str, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message in ``queue``.dlq (taken off the queue)."""
    conn = await aio_pika.connect(amqp_url)
    out = []
    async with conn:
        ch = await conn.channel()
        q = await ch.declare_queue(f"{queue}.dlq", passive=True)
        while (got := await q.get(no_ack=True, fail=False)) is not None:
            out.append(got)
    return out


def exactly_once(engine: Engine, ids: list[str]) -> None:
    got = collections.Counter(effects(engine))
    assert set(got) == set(ids), (len(got), len(ids), sorted(set(ids) - set(got))[:5])
    assert max(got.values()) == 1, got.most_common(3)


@contextlib.asynccontextmanager
async def consuming(
    amqp_url: str,
    engine: Engine,
    queue: str,
    **config: Any,
) -> AsyncIterator[Consumer]:
    cfg = ConsumerConfig(name=config.pop("name", "faults"), queue=queue, **config)
    consumer = Consumer(config=cfg, amqp_url=amqp_url, engine=engine, handler=record)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        yield consumer
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


# ---------------------------------------------------------------- the database fails


@pytest.mark.parametrize(("fault", "seconds"), [("refused", 10.0), ("tcp-cut", 5.0)])
async def test_a_database_outage_pauses_the_kit_and_dead_letters_nothing(
    service_urls: dict[str, str],
    pg_url: str,
    amqp_url: str,
    engine: Engine,
    fault: str,
    seconds: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a connection error was a handler failure, requeued at once: each message burnt
    its delivery limit in milliseconds (97-1,865 of 3,000 good messages dead-lettered)."""
    ids = [f"o-{i}" for i in range(3000)]
    split = urlsplit(pg_url)
    proxy = TcpProxy(upstream_host=split.hostname or "127.0.0.1", upstream_port=split.port or 5432)
    await proxy.start()
    kit_engine = consumer_engine(proxy.url_for(pg_url), concurrency=4)
    ready_during: list[bool] = []
    try:
        async with queue_named(amqp_url) as queue:
            await publish(amqp_url, queue, ids, sleep_ms=1)
            with caplog.at_level(logging.INFO, logger="app.consumer"):
                async with consuming(
                    amqp_url, kit_engine, queue, prefetch=200, concurrency=4, delivery_limit=2
                ) as consumer:
                    await until(lambda: len(effects(engine)) >= 600, what="600 effects")
                    if fault == "refused":
                        with database_refusing(service_urls["pg"], pg_url):
                            await asyncio.sleep(1.0)
                            ready_during.append(consumer.ready()[0])
                            await asyncio.sleep(seconds - 1.0)
                    else:
                        await proxy.refuse()
                        await asyncio.sleep(1.0)
                        ready_during.append(consumer.ready()[0])
                        await asyncio.sleep(seconds - 1.0)
                        await proxy.accept()
                    await until(
                        lambda: len(set(effects(engine))) == len(ids),
                        timeout=120,
                        what="every effect",
                    )
                    await until(
                        lambda: consumer.metrics.counts["acked"] >= len(ids), what="every ack"
                    )
                    assert consumer.ready()[0]
            assert await dead_letters(amqp_url, queue) == []
    finally:
        kit_engine.dispose()
        await proxy.close()
    exactly_once(engine, ids)
    c = consumer.metrics.counts
    assert (c["dead_lettered"], c["requeued"], c["handler_failures"]) == (0, 0, 0)
    # a commit whose reply was lost did commit: counted as handled, not as a duplicate
    assert (c["handled"], c["deduplicated"]) == (len(ids), 0)
    assert c["database_outages"] == 1 and c["reconnects"] >= 1
    assert ready_during == [False]
    lines = [r for r in caplog.records if r.name == "app.consumer"]
    down = [r for r in lines if "does not answer" in r.getMessage()]
    back = [r for r in lines if "answers again after" in r.getMessage()]
    assert [r.levelname for r in down] == ["WARNING"] and [r.levelname for r in back] == ["INFO"]
    assert [r for r in lines if r.levelno >= logging.WARNING] == down  # nothing per message


# ---------------------------------------------------------------- a message kills the process


CRASHING = "tests.support.consumer:crash_or_record"


def _spawn(
    pg_url: str, amqp_url: str, queue: str, *extra: str, handler: str = CRASHING
) -> subprocess.Popen[bytes]:
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
            handler,
            "--name",
            "faults",
            *extra,
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("quorum", [False, True], ids=["classic", "quorum"])
async def test_a_message_that_kills_the_process_is_dead_lettered_after_the_limit(
    pg_url: str, amqp_url: str, engine: Engine, quorum: bool
) -> None:
    """Before: on a quorum queue x-delivery-count reached 8 against a limit of 5 and the messages
    behind the poison never had their effect. Only the message whose handler was running is
    charged: the 200 good ones that shared its window (and came back with it) are not."""
    good = [f"g-{i}" for i in range(200)]
    limit = 3
    dead_letter = ("--dead-letter-exchange", "", "--dead-letter-routing-key") if quorum else ()
    async with queue_named(amqp_url, quorum=quorum) as queue:
        await publish(amqp_url, queue, ["poison-1"], crash=True)
        await publish(amqp_url, queue, good)
        extra = ["--delivery-limit", str(limit), "--prefetch", "100"]
        if dead_letter:
            extra += [*dead_letter, f"{queue}.dlq"]
        crashes = 0
        proc = _spawn(pg_url, amqp_url, queue, *extra)
        try:
            deadline = time.monotonic() + 120
            while len(set(effects(engine))) < len(good):
                assert time.monotonic() < deadline, f"stuck after {crashes} crashes"
                if proc.poll() is not None:
                    assert proc.returncode == 137, proc.stderr.read() if proc.stderr else ""
                    crashes += 1
                    assert crashes <= limit + 1, "the poison was not dead-lettered in time"
                    proc = _spawn(pg_url, amqp_url, queue, *extra)
                await asyncio.sleep(0.1)
            await until(lambda: proc.poll() is None, what="the last kit alive")
            letters: list[Any] = []
            while not letters:
                letters = await dead_letters(amqp_url, queue)
                await asyncio.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    assert crashes == limit + 1  # the first delivery, then one per counted attempt
    exactly_once(engine, good)
    assert [m.message_id for m in letters] == ["poison-1"]
    if quorum:  # published by the kit, saying why
        headers = letters[0].headers
        assert headers["x-outbox-dead-letter-attempts"] == limit
        assert "delivery limit 3 reached" in str(headers["x-outbox-dead-letter-reason"])
        assert "ended without an outcome" in str(headers["x-outbox-dead-letter-reason"])
    assert b"dead-letters poison-1" in err, err[-2000:]


# ---------------------------------------------------------------- slow and hung handlers


@pytest.mark.parametrize("mode", ["batch", "message"])
async def test_a_slow_handler_delays_only_itself(amqp_url: str, engine: Engine, mode: str) -> None:
    """Before: acks went out only for an unbroken run of finished deliveries, so one handler
    sleeping 20 s froze effects at 109 of 2,000. Now the others finish and are acked while it
    runs; in batched mode at most the deliveries that ran before it in its window wait with it."""
    before, after = [f"b-{i}" for i in range(500)], [f"a-{i}" for i in range(500)]
    async with queue_named(amqp_url) as queue:
        await publish(amqp_url, queue, before)
        await publish(amqp_url, queue, ["slow-1"], sleep_ms=6000)
        await publish(amqp_url, queue, after)
        async with consuming(
            amqp_url, engine, queue, mode=mode, prefetch=100, batch_size=20, concurrency=4
        ) as consumer:
            hostages = 20 if mode == "batch" else 0
            await until(
                lambda: len(effects(engine)) >= 1000 - hostages,
                timeout=4.5,
                what="the others' effects while the slow handler runs",
            )
            assert "slow-1" not in effects(engine)
            await until(
                lambda: consumer.metrics.counts["acked"] == 1001, timeout=30, what="every ack"
            )
    exactly_once(engine, [*before, "slow-1", *after])


async def test_a_hung_handler_fails_its_attempt_and_the_kit_is_not_ready_meanwhile(
    amqp_url: str, engine: Engine
) -> None:
    """Before: a hung handler stopped the consumer for good while /readyz said ready."""
    good = [f"h-{i}" for i in range(300)]
    async with queue_named(amqp_url) as queue:
        await publish(amqp_url, queue, good[:150])
        await publish(amqp_url, queue, ["hung-1"], sleep_ms=4000)
        await publish(amqp_url, queue, good[150:])
        async with consuming(
            amqp_url,
            engine,
            queue,
            handler_timeout=1.0,
            delivery_limit=2,
            prefetch=100,
            batch_size=20,
        ) as consumer:
            await until(
                lambda: consumer.metrics.oldest_handler_seconds() > 1.2,
                timeout=10,
                what="a handler past its timeout",
            )
            ready, details = consumer.ready()
            assert not ready and float(str(details["oldest_handler_seconds"])) > 1.0
            await until(
                lambda: consumer.metrics.counts["dead_lettered"] == 1,
                timeout=30,
                what="the hung message dead-lettered",
            )
            await until(lambda: len(effects(engine)) == len(good), what="the others' effects")
            await until(
                lambda: consumer.metrics.abandoned_handlers == 0,
                timeout=15,
                what="the hung threads back",
            )
            assert consumer.ready()[0]
            assert consumer.metrics.counts["handler_timeouts"] == 2
        assert [m.message_id for m in await dead_letters(amqp_url, queue)] == ["hung-1"]
    exactly_once(engine, good)  # the hung one's late writes were rolled back


# ---------------------------------------------------------------- all of it in one run


async def test_kill_9_a_database_outage_and_a_broker_close_in_one_run(
    pg_url: str, amqp_url: str, engine: Engine
) -> None:
    ids = [f"r-{i}" for i in range(6000)]
    split = urlsplit(pg_url)
    proxy = TcpProxy(upstream_host=split.hostname or "127.0.0.1", upstream_port=split.port or 5432)
    await proxy.start()
    kit_url = proxy.url_for(pg_url)
    async with queue_named(amqp_url) as queue:
        await publish(amqp_url, queue, ids, sleep_ms=2)
        proc = _spawn(
            kit_url, amqp_url, queue, "--prefetch", "200", handler="tests.support.consumer:record"
        )
        try:
            await until(lambda: len(effects(engine)) >= 1000, timeout=90, what="1,000 effects")
            proc.send_signal(signal.SIGKILL)  # effects committed, acks not all sent
            proc.wait(timeout=30)
            proc = _spawn(
                kit_url,
                amqp_url,
                queue,
                "--prefetch",
                "200",
                handler="tests.support.consumer:record",
            )
            await until(lambda: len(set(effects(engine))) >= 2500, timeout=90, what="2,500")
            closed = await asyncio.to_thread(close_broker_connections, "outbox-consumer faults")
            assert closed == 1
            await until(lambda: len(set(effects(engine))) >= 3500, timeout=90, what="3,500")
            await proxy.refuse()
            await asyncio.sleep(10)
            await proxy.accept()
            await until(
                lambda: len(set(effects(engine))) == len(ids), timeout=120, what="every effect"
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
            await proxy.close()
        assert await dead_letters(amqp_url, queue) == []
    exactly_once(engine, ids)
    lines = err.decode().splitlines()
    assert sum("does not answer" in line for line in lines) == 1, err[-3000:]
    assert sum("answers again after" in line for line in lines) == 1, err[-3000:]
    # the kit logs no traceback and dead-letters nothing (aiormq logs one of its own when the
    # broker forces the connection closed)
    assert not [line for line in lines if " app." in line and "ERROR" in line], err[-3000:]
    assert all(
        "aiormq" in lines[i - 1] for i, line in enumerate(lines) if line.startswith("Traceback")
    ), err[-3000:]
    assert b"dead-letters" not in err, err[-2000:]


# ---------------------------------------------------------------- a batch handler


async def test_a_batch_handler_handles_windows_and_a_poison_fails_alone(
    amqp_url: str, engine: Engine
) -> None:
    """A batch handler gets a window's messages at once; a window it fails runs again one
    message at a time, so only the poison is charged and dead-lettered."""
    from tests.support.consumer import record_all

    good = [f"w-{i}" for i in range(2000)]
    async with queue_named(amqp_url) as queue:
        await publish(amqp_url, queue, good[:1000])
        await publish(amqp_url, queue, ["poison-1"], poison=True)
        await publish(amqp_url, queue, good[1000:])
        await publish(amqp_url, queue, good[:100])  # duplicates: deduplicated
        cfg = ConsumerConfig(name="batches", queue=queue, delivery_limit=2)
        consumer = Consumer(config=cfg, amqp_url=amqp_url, engine=engine, batch_handler=record_all)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        try:
            counts = consumer.metrics.counts
            await until(
                lambda: counts["acked"] + counts["dead_lettered"] == 2101, what="all settled"
            )
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        assert [m.message_id for m in await dead_letters(amqp_url, queue)] == ["poison-1"]
    exactly_once(engine, good)
    c = consumer.metrics.counts
    assert (c["handled"], c["deduplicated"], c["dead_lettered"]) == (2000, 100, 1)
    assert c["transactions"] < 1000  # windows, not a transaction per message
