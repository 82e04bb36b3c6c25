"""Publish-path measurements against the local RabbitMQ (and PostgreSQL): median of N runs.

    python bench/drain_probe.py [--runs 3] [--messages 20000] [--only aio-pika,wire,pg,sqlite]
                                [--claim-batch N] [--window N]   (drains; default: Settings)

Cases (persistent 256-byte messages to a durable queue, publisher confirms on):

- ``aio-pika-1``: aio-pika, awaiting each publish's confirm before the next (window 1)
- ``aio-pika``:   aio-pika with 1,000 publishes in flight (one task/future each)
- ``wire``:       this project's pamqp wire layer, batches of 500 in one write, window 5,000
- ``pg`` / ``sqlite``: the full publisher draining an outbox until empty (claims, confirms and
  DB bookkeeping included), on a fresh PostgreSQL database / SQLite file

URLs come from OUTBOX_AMQP_URL and OUTBOX_DATABASE_URL (a PostgreSQL admin URL that may create
databases), else from ``deploy/local/services.sh env``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aio_pika  # noqa: E402
from sqlalchemy import insert, make_url, text  # noqa: E402

from app.amqp.codec import OutgoingMessage, ReturnedMessage, marshal_properties  # noqa: E402
from app.amqp.connection import AMQPConnection  # noqa: E402
from app.amqp.errors import CloseReason  # noqa: E402
from app.db import make_engine, migrate  # noqa: E402
from app.outbox.schema import outbox  # noqa: E402
from app.outbox.store import PublisherStore  # noqa: E402
from app.publisher.engine import Publisher  # noqa: E402
from app.settings import Settings  # noqa: E402

BODY = b"x" * 256


def service_urls() -> tuple[str, str]:
    amqp, db = os.environ.get("OUTBOX_AMQP_URL"), os.environ.get("OUTBOX_DATABASE_URL", "")
    if amqp and db.startswith("postgresql"):
        return amqp, db
    out = subprocess.run(
        [str(REPO / "deploy/local/services.sh"), "env"], check=True, capture_output=True, text=True
    ).stdout
    env = dict(
        line.removeprefix("export ").split("=", 1) for line in out.splitlines() if "=" in line
    )
    return amqp or env["OUTBOX_AMQP_URL"], env["OUTBOX_DATABASE_URL"]


async def with_queue(amqp_url: str, body: Callable[[str], Awaitable[float]]) -> float:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        queue = await ch.declare_queue(name, durable=True)
        try:
            return await body(name)
        finally:
            await queue.delete(if_unused=False, if_empty=False)


# ---------------------------------------------------------------- aio-pika


async def aio_pika_rate(amqp_url: str, n: int, window: int) -> float:
    async def run(queue: str) -> float:
        conn = await aio_pika.connect(amqp_url)
        async with conn:
            ch = await conn.channel(publisher_confirms=True)
            gate = asyncio.Semaphore(window)

            async def one(i: int) -> None:
                async with gate:
                    msg = aio_pika.Message(
                        BODY,
                        message_id=f"m{i}",
                        headers={"x-outbox-id": i},
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    )
                    await ch.default_exchange.publish(msg, routing_key=queue)

            start = time.perf_counter()
            if window == 1:
                for i in range(n):
                    await one(i)
            else:
                await asyncio.gather(*(one(i) for i in range(n)))
            return n / (time.perf_counter() - start)

    return await with_queue(amqp_url, run)


# ---------------------------------------------------------------- wire layer


class _Counter:
    def __init__(self) -> None:
        self.acked = 0
        self.changed = asyncio.Event()

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        self.acked = max(self.acked, delivery_tag)
        self.changed.set()

    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        raise RuntimeError("nack in the benchmark")

    def on_return(self, channel_id: int, message: ReturnedMessage) -> None: ...
    def on_channel_closed(self, channel_id: int, reason: CloseReason) -> None: ...
    def on_blocked(self, reason: str) -> None: ...
    def on_unblocked(self) -> None: ...
    def on_connection_lost(self, reason: CloseReason) -> None: ...


async def wire_rate(amqp_url: str, n: int, window: int = 5000, batch: int = 500) -> float:
    async def run(queue: str) -> float:
        counter = _Counter()
        conn = await AMQPConnection.connect(amqp_url, listener=counter)
        channel = await conn.open_channel()
        start = time.perf_counter()
        sent = 0
        while counter.acked < n:
            while sent < n and sent - counter.acked < window:
                count = min(batch, n - sent)
                conn.publish_batch(
                    channel,
                    [
                        OutgoingMessage(
                            "",
                            queue,
                            BODY,
                            marshal_properties(
                                {
                                    "delivery_mode": 2,
                                    "message_id": f"m{i}",
                                    "headers": {"x-outbox-id": i},
                                }
                            ),
                        )
                        for i in range(sent, sent + count)
                    ],
                )
                sent += count
                await conn.drain()
            counter.changed.clear()
            if counter.acked < n:
                await counter.changed.wait()
        rate = n / (time.perf_counter() - start)
        await conn.close()
        return rate

    return await with_queue(amqp_url, run)


# ---------------------------------------------------------------- full drain


def fill(url: str, n: int, queue: str) -> None:
    engine = make_engine(url)
    rows = [
        {
            "message_id": f"{queue}-{i}",
            "batch_id": "bench",
            "exchange": "",
            "routing_key": queue,
            "body": BODY,
        }
        for i in range(n)
    ]
    with engine.begin() as conn:
        for start in range(0, n, 5000):
            conn.execute(insert(outbox), rows[start : start + 5000])
    engine.dispose()


#: Settings overrides for the drain cases (--claim-batch, --window).
DRAIN_OVERRIDES: dict[str, int] = {}


async def drain_rate(amqp_url: str, db_url: str, n: int) -> float:
    async def run(queue: str) -> float:
        await asyncio.to_thread(fill, db_url, n, queue)
        settings = Settings(
            database_url=db_url,
            amqp_url=amqp_url,
            poll_interval=0.05,  # type: ignore[arg-type]
            **DRAIN_OVERRIDES,
        )
        engine = make_engine(db_url, pool_pre_ping=False)  # as run_publisher builds it
        try:
            publisher = Publisher(settings=settings, store=PublisherStore(engine))
            start = time.perf_counter()
            stats = await publisher.run(until_empty=True)
            elapsed = time.perf_counter() - start
        finally:
            engine.dispose()
        assert stats.confirmed == n, stats
        return n / elapsed

    return await with_queue(amqp_url, run)


def fresh_pg(admin_url: str) -> tuple[str, Callable[[], None]]:
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    migrate(url)

    def drop() -> None:  # autovacuum may hold the fresh database for a moment: retry
        for attempt in range(20):
            try:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
                break
            except Exception as exc:
                if attempt == 19:
                    print(f"could not drop {name}: {exc}", file=sys.stderr)
                time.sleep(0.5)
        admin.dispose()

    return url, drop


async def pg_rate(amqp_url: str, admin_url: str, n: int) -> float:
    url, drop = fresh_pg(admin_url)
    try:
        return await drain_rate(amqp_url, url, n)
    finally:
        drop()


async def sqlite_rate(amqp_url: str, n: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        migrate(url)
        return await drain_rate(amqp_url, url, n)


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--only", default="aio-pika-1,aio-pika,wire,pg,sqlite")
    parser.add_argument("--claim-batch", type=int, help="drains: Settings.claim_batch")
    parser.add_argument("--window", type=int, help="drains: Settings.window")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args()
    if args.claim_batch:
        DRAIN_OVERRIDES["claim_batch"] = args.claim_batch
    if args.window:
        DRAIN_OVERRIDES["window"] = args.window
    amqp_url, admin_url = service_urls()
    n = args.messages
    cases: dict[str, Callable[[], Awaitable[float]]] = {
        "aio-pika-1": lambda: aio_pika_rate(amqp_url, max(1000, n // 10), 1),
        "aio-pika": lambda: aio_pika_rate(amqp_url, n, 1000),
        "wire": lambda: wire_rate(amqp_url, n),
        "pg": lambda: pg_rate(amqp_url, admin_url, n),
        "sqlite": lambda: sqlite_rate(amqp_url, n),
    }
    results: dict[str, dict[str, object]] = {}
    for name in args.only.split(","):
        rates = [asyncio.run(cases[name]()) for _ in range(args.runs)]
        median, runs = statistics.median(rates), [round(r) for r in rates]
        load = round(os.getloadavg()[0], 1)
        results[name] = {"median": median, "runs": runs, "load1": load}
        print(f"{name:11s} median {median:8.0f} msg/s   runs {runs}   load {load}", flush=True)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
