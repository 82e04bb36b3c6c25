"""Spark ``local[2]``: one DataFrame of N rows into the outbox (the product's ``write_outbox``)
and into a plain table (Spark's own JDBC writer, Debian's PostgreSQL JDBC jar).

Runs in its own process (the JVM stays out of the driver): ``python -m bench.workloads.spark
--rows N --url URL --repeats R`` prints one JSON line ``{"outbox": [...], "jdbc": [...], ...}``
(rows/s per run), and ``jdbc_keys`` (JDBC into a table with the outbox's primary key and unique
``message_id``: like for like) and ``derived`` (``write_outbox`` without a key column: ids from
each row's content, one shuffle more). The DataFrame (``id``, ``key``, a 256-character
``payload``) is cached and counted before any write, so every writer is timed on the write
alone; each run goes through the writers in turn, each into emptied tables, after one small
untimed warm-up each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

JDBC_JAR = Path(os.environ.get("BENCH_JDBC_JAR", "/usr/share/java/postgresql.jar"))
JDBC_TABLE = "bench_jdbc_plain"
#: Like for like: the outbox's identity and uniqueness (a bigserial primary key, a unique
#: ``message_id``), the same message columns, written by Spark's JDBC writer.
JDBC_KEYS_TABLE = "bench_jdbc_keys"
KEYS_DDL = (f"CREATE TABLE {JDBC_KEYS_TABLE} (id bigserial PRIMARY KEY, message_id text NOT NULL "
            "UNIQUE, batch_id text NOT NULL, exchange text NOT NULL, routing_key text NOT NULL, "
            "body bytea NOT NULL)")  # fmt: skip
WARMUP_ROWS = 2_000


def _spark() -> Any:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    return (
        SparkSession.builder.master("local[2]")
        .appName("outbox-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.jars", str(JDBC_JAR))
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )


def _frame(spark: Any, rows: int) -> Any:
    from pyspark.sql import functions as F

    payload = F.rpad(F.sha2(F.col("id").cast("string"), 256), 256, "x")
    return spark.range(rows, numPartitions=2).select(
        F.col("id"), F.concat(F.lit("key-"), F.col("id")).alias("key"), payload.alias("payload")
    )


def _jdbc_props(url: str) -> tuple[str, dict[str, str]]:
    """SQLAlchemy URL → (jdbc URL, properties) for Spark's JDBC writer."""
    rest = url.split("://", 1)[1]
    creds, _, hostdb = rest.rpartition("@")
    user, _, password = creds.partition(":")
    props = {"user": user, "password": password, "driver": "org.postgresql.Driver"}
    return f"jdbc:postgresql://{hostdb}", props


def _reset(url: str) -> None:
    conninfo = "postgresql://" + url.split("://", 1)[1]
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {JDBC_TABLE}")
        conn.execute(f"DROP TABLE IF EXISTS {JDBC_KEYS_TABLE}")
        conn.execute(KEYS_DDL)
        conn.execute("TRUNCATE outbox, outbox_batches, outbox_rejects")
        conn.execute("VACUUM ANALYZE outbox")


def _write_jdbc(df: Any, url: str) -> None:
    jdbc_url, props = _jdbc_props(url)
    df.write.mode("append").jdbc(jdbc_url, JDBC_TABLE, properties=props)


def _write_jdbc_keys(df: Any, url: str, batch: int) -> None:
    from pyspark.sql import functions as F

    jdbc_url, props = _jdbc_props(url)
    rows = df.select(
        F.col("key").alias("message_id"), F.lit(f"bench:{batch}").alias("batch_id"),
        F.lit("bench.spark").alias("exchange"), F.lit("bench").alias("routing_key"),
        F.col("payload").cast("binary").alias("body"),
    )  # fmt: skip
    rows.write.mode("append").jdbc(jdbc_url, JDBC_KEYS_TABLE, properties=props)


def _write_outbox(df: Any, url: str, batch: int, *, derived: bool = False) -> None:
    from spark_writer import write_outbox

    result = write_outbox(df, url=url, sink="bench", batch_id=batch, exchange="bench.spark",
                          routing_key="bench", body_column="payload",
                          message_id_column=None if derived else "key")  # fmt: skip
    if result.written != result.rows:
        raise RuntimeError(f"write_outbox wrote {result.written} of {result.rows} rows")


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--url", required=True, help="SQLAlchemy URL of a migrated PostgreSQL")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    spark = _spark()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        warm = _frame(spark, WARMUP_ROWS).cache()
        warm.count()
        _reset(args.url)
        _write_jdbc(warm, args.url)
        _write_jdbc_keys(warm, args.url, 0)
        _write_outbox(warm, args.url, batch=0)
        _reset(args.url)
        _write_outbox(warm, args.url, batch=0, derived=True)
        df = _frame(spark, args.rows).cache()
        df.count()
        out: dict[str, list[float]] = {"outbox": [], "jdbc": [], "jdbc_keys": [], "derived": []}
        writers = {
            "jdbc": lambda i: _write_jdbc(df, args.url),
            "jdbc_keys": lambda i: _write_jdbc_keys(df, args.url, i + 1),
            "outbox": lambda i: _write_outbox(df, args.url, batch=i + 1),
            "derived": lambda i: _write_outbox(df, args.url, batch=i + 1, derived=True),
        }
        for i in range(args.repeats):
            for name, write in writers.items():
                _reset(args.url)
                out[name].append(args.rows / _timed(lambda w=write, i=i: w(i)))
            figures = ", ".join(f"{k} {v[-1]:,.0f}" for k, v in out.items())
            print(f"  spark run {i + 1}/{args.repeats} (rows/s): {figures}", file=sys.stderr,
                  flush=True)  # fmt: skip
    finally:
        spark.stop()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
