"""What ``wait="confirmed"`` costs: Spark ``local[2]`` writes one DataFrame of N rows (200,000 at
``BENCH_SCALE=1``, the ``spark`` group's frame) with ``write_outbox`` while a publisher runs,
once ending when the rows are written (``wait="written"``, the default) and once ending when
every row is confirmed (``wait="confirmed"``), in turn in each run, on one PostgreSQL database
and one queue.

After one untimed warm-up write, each run writes both cases, in turn (the first alternates).
Per case and run: the job's own time (``write_outbox`` called to returned) and the time until
the last row was confirmed (the newest ``confirmed_at`` less the call's start), both as rows/s.
Without the wait the job ends early and the rows are confirmed later; with it the job ends
once they are, so its rows/s is the delivery's own, and set against the delivery of the run
without the wait it shows what waiting adds (its polls, and the pause after the last confirm).

Runs in its own process (the JVM stays out of the driver): ``python -m
bench.workloads.spark_wait --rows N --url URL --amqp URL --repeats R`` prints one JSON line
``{"written_job": [...], "written_delivered": [...], "confirmed_job": [...],
"confirmed_delivered": [...]}`` (rows/s per run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pika
import psycopg

from bench.common import Services, topology
from bench.workloads.drain import start_publisher
from bench.workloads.spark import WARMUP_ROWS, _frame

CASES = ("written", "confirmed")


def _spark(tmp: Path) -> Any:
    """The ``spark`` group's session (``local[2]``, 1 GB driver) without its JDBC jar."""
    import os

    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    return (
        SparkSession.builder.master("local[2]")
        .appName("outbox-bench-wait")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.local.dir", str(tmp / "spark"))
        .getOrCreate()
    )


def _conninfo(url: str) -> str:
    return "postgresql://" + url.split("://", 1)[1]


def _reset(url: str, amqp_url: str, queue: str) -> None:
    """An empty outbox and queue before each write (the publisher keeps running)."""
    with psycopg.connect(_conninfo(url), autocommit=True) as conn:
        conn.execute("TRUNCATE outbox, outbox_batches, outbox_rejects, outbox_held")
    broker = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        broker.channel().queue_purge(queue)
    finally:
        broker.close()


def _last_confirm(url: str, rows: int, timeout: float) -> dt.datetime:
    """The newest ``confirmed_at`` once all ``rows`` are confirmed (polled every 100 ms)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(_conninfo(url), autocommit=True) as conn:
        while True:
            count, last = conn.execute(
                "SELECT count(*), max(confirmed_at) FROM outbox WHERE status = 'confirmed'"
            ).fetchone() or (0, None)
            if count == rows and last is not None:
                return last
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} of {rows} rows confirmed after {timeout:.0f}s")
            time.sleep(0.1)


def _write(df: Any, url: str, exchange: str, routing_key: str, *, batch: int, wait: str) -> None:
    """The whole frame as one batch into the outbox, every row routed to the queue."""
    from spark_writer import write_outbox

    result = write_outbox(
        df,
        url=url,
        sink="bench-wait",
        batch_id=batch,
        exchange=exchange,
        routing_key=routing_key,
        body_column="payload",
        message_id_column="key",
        wait=wait,
        wait_timeout=600,
    )
    if result.written != result.rows:
        raise RuntimeError(f"write_outbox wrote {result.written} of {result.rows} rows")
    if wait == "confirmed" and (result.delivery is None or not result.delivery.ok):
        raise RuntimeError(f"the wait ended with {result.delivery}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--url", required=True, help="SQLAlchemy URL of a migrated PostgreSQL")
    parser.add_argument("--amqp", required=True, help="the broker's AMQP URL")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="outbox-bench-spark-wait-"))
    (tmp / "python").mkdir()
    (tmp / "spark").mkdir()
    services = Services(amqp_url=args.amqp, database_url=args.url)
    out: dict[str, list[float]] = {f"{c}_{w}": [] for c in CASES for w in ("job", "delivered")}
    spark = _spark(tmp)
    spark.sparkContext.setLogLevel("ERROR")
    with topology(services, "spark-wait") as topo:
        publisher = start_publisher(services, args.url, tmp, until_empty=False, name="wait")
        try:
            warm = _frame(spark, WARMUP_ROWS).cache()  # JVM, Python workers, publisher: untimed
            warm.count()
            _reset(args.url, args.amqp, topo.queue)
            _write(warm, args.url, topo.exchange, topo.routing_key, batch=0, wait="confirmed")
            df = _frame(spark, args.rows).cache()
            df.count()
            batch = 0
            for i in range(args.repeats):
                for wait in CASES if i % 2 == 0 else CASES[::-1]:  # neither always goes first
                    _reset(args.url, args.amqp, topo.queue)
                    batch += 1
                    start = dt.datetime.now(dt.UTC)
                    began = time.perf_counter()
                    _write(df, args.url, topo.exchange, topo.routing_key, batch=batch, wait=wait)
                    job = time.perf_counter() - began
                    last = _last_confirm(args.url, args.rows, timeout=600)
                    delivered = (last - start).total_seconds()
                    out[f"{wait}_job"].append(args.rows / job)
                    out[f"{wait}_delivered"].append(args.rows / delivered)
                    print(
                        f"  spark wait run {i + 1}/{args.repeats} wait={wait}: job {job:.1f}s "
                        f"({args.rows / job:,.0f} rows/s), last confirm after {delivered:.1f}s "
                        f"({args.rows / delivered:,.0f} rows/s)",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            publisher.stop()
            spark.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    publisher.check()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
