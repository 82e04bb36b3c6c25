"""``outbox demo``: the main job end to end on local defaults.

Order events as JSON files -> a Spark Structured Streaming job writing through the foreachBatch
sink -> the outbox (SQLite embedded default, or ``OUTBOX_DATABASE_URL``) -> the publisher on
confirm-mode channels -> RabbitMQ -> the consumer kit (inbox, manual acks), checking every
message arrived and had its effect once. The publisher runs beside the Spark job, which writes
with ``wait="confirmed"``: each micro-batch commits only once RabbitMQ confirmed its rows, and
the job reports what the broker made of them from Spark's side (``sink.totals`` and its
progress listener).
Each run has its own id, input folder, checkpoint, sink name and queue, so running it again works.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import Engine, func, select

from app.db import make_engine, migrate
from app.outbox.schema import outbox
from app.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

EXCHANGE = "demo.orders"
EVENTS = ("order.created", "order.paid", "order.shipped")


@dataclass
class DemoReport:
    run_id: str
    rows: int
    written: int = 0
    batches: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    received: int = 0
    missing: int = 0
    duplicates_received: int = 0
    lost_confirms: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    #: what the Spark job learnt with wait="confirmed" (its sink's totals)
    spark_confirmed: int = 0
    spark_undelivered: int = 0
    #: one line per micro-batch: Spark's progress with the outbox's delivery
    spark_progress: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        confirmed = self.statuses.get("confirmed", 0)
        seen = self.spark_confirmed == confirmed and not self.spark_undelivered
        return self.written == self.rows == confirmed and self.missing == 0 and seen


def progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


# ------------------------------------------------------------------ dataset


def generate_orders(folder: Path, *, rows: int, files: int, seed: int, run_id: str) -> None:
    """Order events as JSON lines, split over ``files`` files (one micro-batch each).

    Event ids are the message ids: unique per run, or a second run would (rightly) be skipped
    as a replay of the first."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    start = dt.datetime(2026, 11, 21, 8, 0, tzinfo=dt.UTC)
    for f in range(files):
        lines = []
        for i in range(f * per_file, min(rows, (f + 1) * per_file)):
            lines.append(json.dumps(_order(i, rng, start, run_id)))
        # write then rename: Spark's file source must never see half a file
        tmp = folder / f".orders-{f:04d}.json.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(folder / f"orders-{f:04d}.json")


def _order(i: int, rng: random.Random, start: dt.datetime, run_id: str) -> dict[str, Any]:
    return {
        "event_id": f"evt-{run_id}-{i:08d}",
        "event_type": EVENTS[i % len(EVENTS)],
        "order_id": f"ord-{i // len(EVENTS):07d}",
        "customer_id": f"cust-{rng.randrange(5000):05d}",
        "amount_cents": rng.randrange(500, 50_000),
        "currency": rng.choice(["EUR", "USD", "GBP"]),
        "items": rng.randrange(1, 8),
        "event_time": (start + dt.timedelta(seconds=i)).isoformat(),
    }


# ------------------------------------------------------------------ broker


async def declare_topology(amqp_url: str, queue: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        ex = await ch.declare_exchange(EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
        q = await ch.declare_queue(queue, durable=True, arguments={"x-queue-type": "classic"})
        await q.bind(ex, routing_key="order.#")


async def consume_all(
    amqp_url: str,
    queue: str,
    *,
    engine: Engine,
    consumer_name: str,
    expected: int,
    tick: Callable[[int], None],
    timeout: float,
) -> tuple[set[str], int]:
    """Consume the run's queue with the consumer kit (manual acks, prefetch, the inbox in the
    outbox database) until ``expected`` distinct messages were handled (or ``timeout``); return
    the handled message ids and how many deliveries the inbox absorbed as duplicates. Deletes
    the queue afterwards."""
    import threading

    import aio_pika

    from app.consumer import Consumer, ConsumerConfig, Message

    handled: set[str] = set()
    lock = threading.Lock()

    def verify(message: Message, _conn: object) -> None:  # the effect: count it once
        with lock:
            handled.add(message.message_id)

    consumer = Consumer(
        config=ConsumerConfig(name=consumer_name, queue=queue, prefetch=500, concurrency=4),
        amqp_url=amqp_url,
        engine=engine,
        handler=verify,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    deadline = time.monotonic() + timeout
    while len(handled) < expected and time.monotonic() < deadline and not task.done():
        await asyncio.sleep(0.1)
        tick(len(handled))
    await asyncio.sleep(0.5)  # late duplicates still arrive: the inbox absorbs them, counted
    stop.set()
    await task
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        await (await conn.channel()).queue_delete(queue)
    return handled, consumer.metrics.counts["deduplicated"]


# ------------------------------------------------------------------ steps


@dataclass
class SparkSide:
    """What the Spark job saw: the sink's totals and a line per micro-batch's progress."""

    batches: int = 0
    written: int = 0
    confirmed: int = 0
    undelivered: int = 0
    progress: list[str] = field(default_factory=list)


def _demo_spark() -> tuple[SparkSession, bool]:
    """A local Spark on loopback for the demo, and whether this job started it (and so stops
    it: a session the caller had running is left running)."""
    import os

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors use this interpreter
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    ours = SparkSession.getActiveSession() is None  # stop only a session this job started
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("outbox-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    if ours:
        spark.sparkContext.setLogLevel("ERROR")
    return spark, ours


def run_spark_job(
    settings: Settings,
    *,
    input_dir: Path,
    checkpoint: Path,
    sink: str,
    on_progress: Callable[[int], None] = lambda confirmed: None,
) -> SparkSide:
    """Structured Streaming over the JSON files, written through the foreachBatch sink, each
    micro-batch waiting until RabbitMQ confirmed its rows; ``on_progress`` gets the rows
    confirmed so far about every second while the query runs."""
    from spark_writer import OutboxSink
    from spark_writer.progress import progress_line

    spark, ours = _demo_spark()
    try:
        schema = (
            "event_id STRING, event_type STRING, order_id STRING, customer_id STRING, "
            "amount_cents LONG, currency STRING, items INT, event_time STRING"
        )
        stream = (
            spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(input_dir))
        )
        writer = OutboxSink(
            url=settings.database_url.get_secret_value(),
            sink=sink,
            exchange=EXCHANGE,
            routing_key_column="event_type",
            message_id_column="event_id",
            header_columns=["order_id"],
            ordering_key_column="order_id",
            wait="confirmed",  # a micro-batch commits once the broker confirmed its rows
            wait_timeout=120,
        )
        spark.streams.addListener(writer.progress)
        try:
            query = (
                stream.writeStream.foreachBatch(writer)  # type: ignore[arg-type]  # a result
                .queryName(sink)
                .option("checkpointLocation", str(checkpoint))
                .trigger(availableNow=True)
                .start()
            )
            while not query.awaitTermination(1):
                on_progress(writer.totals.confirmed)
            on_progress(writer.totals.confirmed)
            kept = _kept_progress(writer.progress, query, writer.totals.batches)
        finally:
            spark.streams.removeListener(writer.progress)
        t = writer.totals
        return SparkSide(
            batches=t.batches,
            written=t.written,
            confirmed=t.confirmed,
            undelivered=t.returned + t.nacked + t.failed + t.skipped + t.unsettled,
            progress=[progress_line(doc) for doc in kept],
        )
    finally:
        if ours:
            spark.stop()


def _kept_progress(listener: Any, query: Any, batches: int) -> list[dict[str, Any]]:
    """The listener's progress of ``query`` once Spark's listener bus delivered every batch's
    (it runs apart from the query; a few seconds at most)."""
    deadline = time.monotonic() + 10
    while len(listener.progress(query)) < batches and time.monotonic() < deadline:
        time.sleep(0.05)
    kept: list[dict[str, Any]] = listener.progress(query)
    return kept


@contextlib.contextmanager
def publisher_running(settings: Settings) -> Iterator[None]:
    """The publisher on a loop in a thread of this process while the block runs; stopped
    gracefully (it settles its window) when the block ends."""
    from app.publisher.service import run_publisher

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    own_port = settings.model_copy(update={"publisher_metrics_port": 0})
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(run_publisher(own_port, stop=stop)),
        name="demo-publisher",
        daemon=True,
    )
    thread.start()
    try:
        yield
    finally:
        if thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()


def outbox_counts(engine: Engine, sink: str) -> dict[str, int]:
    stmt = (
        select(outbox.c.status, func.count(), func.sum(outbox.c.lost_confirms))
        .where(outbox.c.batch_id.like(f"{sink}:%"))
        .group_by(outbox.c.status)
    )
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    counts = {status: int(n) for status, n, _ in rows}
    counts["_lost_confirms"] = sum(int(lost or 0) for _, _, lost in rows)
    return counts


def run_demo(
    settings: Settings, *, rows: int, files: int, workdir: Path, console: Console | None = None
) -> DemoReport:
    console = console or Console(stderr=True)
    run_id = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]
    sink, queue = f"demo-{run_id}", f"demo.orders.{run_id}"
    base = workdir / run_id
    report = DemoReport(run_id=run_id, rows=rows)
    db_url = settings.database_url.get_secret_value()
    engine = make_engine(db_url)
    amqp = settings.amqp_url.get_secret_value()
    t = time.monotonic()

    console.print(f"[bold]outbox demo[/] run {run_id}: {rows} order events")
    migrate(db_url)
    asyncio.run(declare_topology(amqp, queue))
    generate_orders(base / "input", rows=rows, files=files, seed=7, run_id=run_id)
    report.timings["generate"] = time.monotonic() - t

    with progress(console) as bar:
        t = time.monotonic()
        task = bar.add_task(f"Spark -> confirmed ({files} batches)", total=rows)
        with publisher_running(settings):
            spark_side = run_spark_job(
                settings,
                input_dir=base / "input",
                checkpoint=base / "checkpoint",
                sink=sink,
                on_progress=lambda confirmed: bar.update(task, completed=confirmed),
            )
        report.timings["spark"] = time.monotonic() - t
        report.written = _written(engine, sink)
        report.batches = spark_side.batches
        report.spark_confirmed = spark_side.confirmed
        report.spark_undelivered = spark_side.undelivered
        report.spark_progress = spark_side.progress
        task = bar.add_task("consume + verify", total=report.written)
        handled, duplicates = asyncio.run(
            consume_all(
                amqp,
                queue,
                engine=engine,
                consumer_name=f"demo-{run_id}",
                expected=report.written,
                timeout=120,
                tick=lambda n: bar.update(task, completed=n),
            )
        )

    counts = outbox_counts(engine, sink)
    report.lost_confirms = counts.pop("_lost_confirms")
    report.statuses = counts
    report.received = len(handled)
    report.duplicates_received = duplicates
    report.missing = report.written - len(handled & set(_message_ids(engine, sink)))
    engine.dispose()
    return report


def _written(engine: Engine, sink: str) -> int:
    return sum(v for k, v in outbox_counts(engine, sink).items() if not k.startswith("_"))


def _message_ids(engine: Engine, sink: str) -> list[str]:
    stmt = select(outbox.c.message_id).where(outbox.c.batch_id.like(f"{sink}:%"))
    with engine.connect() as conn:
        return list(conn.scalars(stmt))


def print_summary(report: DemoReport, settings: Settings, console: Console) -> None:
    table = Table(title=f"outbox demo {report.run_id}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    spark_s = report.timings.get("spark", 0.0)
    rate = report.written / spark_s if spark_s else 0.0
    rows: list[tuple[str, str]] = [
        ("rows generated", f"{report.rows:,}"),
        ("rows written to the outbox (Spark)", f"{report.written:,}"),
        (
            f"confirmed, as the Spark job saw it ({report.batches} batches waited)",
            f"{report.spark_confirmed:,}",
        ),
        ("not delivered, as the Spark job saw it", f"{report.spark_undelivered:,}"),
        ("confirmed by RabbitMQ (the outbox)", f"{report.statuses.get('confirmed', 0):,}"),
        (
            "returned / nacked / failed",
            "{:,} / {:,} / {:,}".format(
                report.statuses.get("returned", 0),
                report.statuses.get("nacked", 0),
                report.statuses.get("failed", 0),
            ),
        ),
        ("received by the consumer", f"{report.received:,}"),
        ("missing", f"{report.missing:,}"),
        (
            "duplicates received / lost confirms",
            f"{report.duplicates_received} / {report.lost_confirms}",
        ),
        ("Spark job time (written and confirmed)", f"{spark_s:.1f} s"),
        ("written + confirmed throughput", f"{rate:,.0f} msg/s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print("[bold]Spark's progress per micro-batch, with its delivery:[/]")
    for line in report.spark_progress:
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    verdict = "[green]OK: every row confirmed and received[/]" if report.ok else "[red]FAILED[/]"
    console.print(verdict)
    console.print(
        "Next: [bold]outbox status[/]; the API: [bold]outbox serve --insecure[/] then "
        "[bold]curl -s 127.0.0.1:8080/v1/stats[/]"
    )
    if settings.is_sqlite:
        console.print(f"The outbox is {settings.database_url.get_secret_value()} (SQLite).")


def main(settings: Settings, *, rows: int, files: int, workdir: Path) -> int:
    console = Console(stderr=False)
    report = run_demo(settings, rows=rows, files=files, workdir=workdir, console=console)
    print_summary(report, settings, console)
    return 0 if report.ok else 1


def cli(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="outbox demo", description=__doc__)
    parser.add_argument("--rows", type=int, default=20_000, help="order events to generate")
    parser.add_argument("--files", type=int, default=4, help="input files (= micro-batches)")
    parser.add_argument("--workdir", type=Path, default=Path("demo-data"), help="run folders")
    args = parser.parse_args(argv)
    return main(Settings(), rows=args.rows, files=args.files, workdir=args.workdir)


if __name__ == "__main__":
    sys.exit(cli())
