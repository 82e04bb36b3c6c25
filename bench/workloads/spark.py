"""Spark ``local[2]``: one DataFrame of N rows into the outbox (the product's ``write_outbox``)
and into a plain table (Spark's own JDBC writer, Debian's PostgreSQL JDBC jar).

Runs in its own process (the JVM stays out of the driver): ``python -m bench.workloads.spark
--rows N --url URL --repeats R`` prints one JSON line ``{"outbox": [...], "jdbc": [...], ...}``
(rows/s per run: fail mode, the batch held while its tasks check and write it, the input
read once), ``reject`` (``write_outbox`` in reject mode: no hold), ``jdbc_keys`` (JDBC into a
table with the outbox's primary key and unique ``message_id``: like for like), ``derived``
(``write_outbox`` without a key column: ids from each row's content, one shuffle more) and
``copy_floor`` (the same rows, encoded beforehand, COPYed into the emptied outbox by two
connections at once, as the two tasks write: PostgreSQL's part alone, no Spark). The
DataFrame (``id``, ``key``, a 256-character ``payload``) is cached and counted before any
write, so every writer is timed on the write alone; each run goes through the writers in turn,
each into emptied tables, after one small untimed warm-up each. Per writer and run: CPU
microseconds per row of the Spark process tree (driver, JVM, Python workers) and of PostgreSQL
(its postmaster and backends), from the processes' own counters, and the peak of the
executors' temporary disk (``TMPDIR`` of the Python workers and ``spark.local.dir``, sampled
every 10 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa

from bench.proccpu import ServiceCpu, subtree_cpu_seconds
from spark_writer.pgcopy import SIGNATURE, Const, encode

JDBC_JAR = Path(os.environ.get("BENCH_JDBC_JAR", "/usr/share/java/postgresql.jar"))
JDBC_TABLE = "bench_jdbc_plain"
#: Like for like: the outbox's identity and uniqueness (a bigserial primary key, a unique
#: ``message_id``), the same message columns, written by Spark's JDBC writer.
JDBC_KEYS_TABLE = "bench_jdbc_keys"
KEYS_DDL = (
    f"CREATE TABLE {JDBC_KEYS_TABLE} (id bigserial PRIMARY KEY, message_id text NOT NULL "
    "UNIQUE, batch_id text NOT NULL, exchange text NOT NULL, routing_key text NOT NULL, "
    "body bytea NOT NULL)"
)
WARMUP_ROWS = 2_000


def _spark(tmp: Path) -> Any:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["TMPDIR"] = str(tmp / "python")  # the Python workers inherit it
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
        .config("spark.local.dir", str(tmp / "spark"))
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
        conn.execute("TRUNCATE outbox, outbox_batches, outbox_rejects, outbox_held")
        conn.execute("VACUUM ANALYZE outbox")


def _write_jdbc(df: Any, url: str) -> None:
    jdbc_url, props = _jdbc_props(url)
    df.write.mode("append").jdbc(jdbc_url, JDBC_TABLE, properties=props)


def _write_jdbc_keys(df: Any, url: str, batch: int) -> None:
    from pyspark.sql import functions as F

    jdbc_url, props = _jdbc_props(url)
    rows = df.select(
        F.col("key").alias("message_id"),
        F.lit(f"bench:{batch}").alias("batch_id"),
        F.lit("bench.spark").alias("exchange"),
        F.lit("bench").alias("routing_key"),
        F.col("payload").cast("binary").alias("body"),
    )
    rows.write.mode("append").jdbc(jdbc_url, JDBC_KEYS_TABLE, properties=props)


def _write_outbox(
    df: Any, url: str, batch: int, *, derived: bool = False, reject: bool = False
) -> None:
    from spark_writer import write_outbox

    result = write_outbox(
        df,
        url=url,
        sink="bench",
        batch_id=batch,
        exchange="bench.spark",
        routing_key="bench",
        body_column="payload",
        message_id_column=None if derived else "key",
        on_invalid="reject" if reject else "fail",
    )
    if result.written != result.rows:
        raise RuntimeError(f"write_outbox wrote {result.written} of {result.rows} rows")


def _handoff(batches: Any) -> Any:
    """The rows handed to a Python worker as Arrow, counted: Spark's part alone."""
    n = sum(rb.num_rows for rb in batches)
    yield pa.RecordBatch.from_pylist([{"n": n}])


def _mapped(batches: Any, *, schema: Any) -> Any:
    """The hand-off and the writer's own checks and mapping of each row, nothing written."""
    from pyspark import TaskContext

    from spark_writer.envelope import ArrowMapper, BatchRef
    from spark_writer.options import options_of

    context = TaskContext.get()
    mapper = ArrowMapper(
        options=options_of(None, _OPTIONS),
        schema=schema,
        batch=BatchRef(sink="bench", spark_batch_id=0),
        partition=context.partitionId() if context else 0,
    )
    n = 0
    for rb in batches:
        chunk = mapper.map(rb, n)
        if chunk.rejected:
            raise RuntimeError(f"the mapping rejected {len(chunk.rejected)} rows")
        n += rb.num_rows
    yield pa.RecordBatch.from_pylist([{"n": n}])


#: ``_write_outbox``'s options (fail mode, a key column)
_OPTIONS = {
    "url": "postgresql://unused",
    "sink": "bench",
    "exchange": "bench.spark",
    "routing_key": "bench",
    "body_column": "payload",
    "message_id_column": "key",
}


def _read_only(df: Any, rows: int, *, mapped: bool) -> None:
    """Spark's floor under the writer: every row handed to the Python workers (and with
    ``mapped``, checked and mapped by the writer), nothing written."""
    from functools import partial

    task = partial(_mapped, schema=df.schema) if mapped else _handoff
    counted = sum(r["n"] for r in df.mapInArrow(task, "n long").collect())
    if counted != rows:
        raise RuntimeError(f"the read-only pass counted {counted} of {rows} rows")


COPY_COLUMNS = "message_id, body, batch_id, exchange, routing_key"


def copy_data(n: int) -> list[list[bytes]]:
    """The benchmark's rows (``_frame``: ``key-<id>``, a 256-character payload) as binary
    COPY data in blocks of 10,000 rows, split in two halves as the two partitions are."""
    halves: list[list[bytes]] = []
    for part in (range(0, n // 2), range(n // 2, n)):
        ids = [f"key-{i}" for i in part]
        bodies = [hashlib.sha256(str(i).encode()).hexdigest().ljust(256, "x") for i in part]
        constants = [Const.of("bench:floor"), Const.of("bench.spark"), Const.of("bench")]
        blocks = []
        for start in range(0, len(ids), 10_000):
            fields = [
                pa.array(ids[start : start + 10_000]),
                pa.array(bodies[start : start + 10_000]),
                *constants,
            ]
            blocks.append(encode(fields).to_pybytes())
        halves.append(blocks)
    return halves


def copy_rows(url: str, table: str, halves: list[list[bytes]]) -> None:
    """COPY each half on its own connection, both at once; each one transaction."""
    conns = [psycopg.connect(_conninfo(url)) for _ in halves]

    def one(conn: psycopg.Connection[Any], blocks: list[bytes]) -> None:
        with (
            conn.cursor() as cur,
            cur.copy(f"COPY {table} ({COPY_COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy,
        ):
            copy.write(SIGNATURE)
            for block in blocks:
                copy.write(block)
        conn.commit()

    try:
        threads = [
            threading.Thread(target=one, args=pair) for pair in zip(conns, halves, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for conn in conns:
            conn.close()


def _conninfo(url: str) -> str:
    return "postgresql://" + url.split("://", 1)[1]


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a spool removed meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class TempDisk:
    """How far the total size of the files under ``paths`` grew above its size at the start
    while a write runs, sampled every 10 ms: the executors' temporary disk (Python's ``TMPDIR``:
    spools; ``spark.local.dir``: shuffle and spill). Files an earlier write left (Spark removes
    shuffle files lazily) are not counted."""

    def __init__(self, *paths: Path) -> None:
        self.paths = paths
        self.start = self._size()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _size(self) -> int:
        return sum(_dir_bytes(p) for p in self.paths)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._size() - self.start)
            self._stop.wait(0.01)

    def __enter__(self) -> TempDisk:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--url", required=True, help="SQLAlchemy URL of a migrated PostgreSQL")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="outbox-bench-spark-"))
    (tmp / "python").mkdir()
    (tmp / "spark").mkdir()
    spark = _spark(tmp)
    spark.sparkContext.setLogLevel("ERROR")
    postgres = ServiceCpu(postgres=int(_jdbc_props(args.url)[0].rsplit(":", 1)[1].split("/")[0]))
    names = ("outbox", "reject", "jdbc", "jdbc_keys", "derived", "copy_floor", "handoff", "mapped")
    out: dict[str, Any] = {name: [] for name in names}
    out["cpu_us_per_row"] = {name: [] for name in names}
    out["peak_tmp_mb"] = {name: [] for name in names}
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
        floor = copy_data(args.rows)  # encoded before the clock starts: PostgreSQL's part alone
        writers = {
            "outbox": lambda i: _write_outbox(df, args.url, batch=i + 1),
            "reject": lambda i: _write_outbox(df, args.url, batch=i + 1, reject=True),
            "jdbc": lambda i: _write_jdbc(df, args.url),
            "jdbc_keys": lambda i: _write_jdbc_keys(df, args.url, i + 1),
            "derived": lambda i: _write_outbox(df, args.url, batch=i + 1, derived=True),
            # the floor: the same rows COPYed into the emptied outbox by as many connections
            # as the tasks hold (two), no Spark
            "copy_floor": lambda i: copy_rows(args.url, "outbox", floor),
            # Spark's own floor under the writer: the rows handed to the Python workers and
            # counted (``handoff``), and also checked and mapped by the writer (``mapped``)
            "handoff": lambda i: _read_only(df, args.rows, mapped=False),
            "mapped": lambda i: _read_only(df, args.rows, mapped=True),
        }
        for i in range(args.repeats):
            for name, write in writers.items():
                _reset(args.url)
                spark_cpu = subtree_cpu_seconds(os.getpid())
                postgres.start()
                with TempDisk(tmp / "python", tmp / "spark") as disk:
                    seconds = _timed(lambda w=write, i=i: w(i))
                pg = postgres.stop().get("postgres", 0.0)
                spark_cpu = subtree_cpu_seconds(os.getpid()) - spark_cpu
                out[name].append(args.rows / seconds)
                out["cpu_us_per_row"][name].append(
                    {"spark": spark_cpu / args.rows * 1e6, "postgres": pg / args.rows * 1e6}
                )
                out["peak_tmp_mb"][name].append(disk.peak / 1e6)
            figures = ", ".join(
                f"{k} {out[k][-1]:,.0f} ({out['cpu_us_per_row'][k][-1]['spark']:.1f} + "
                f"{out['cpu_us_per_row'][k][-1]['postgres']:.1f} us/row, "
                f"tmp {out['peak_tmp_mb'][k][-1]:.1f} MB)"
                for k in names
            )
            print(
                f"  spark run {i + 1}/{args.repeats} (rows/s): {figures}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
