"""Where the Spark → outbox write spends its time: ``python -m bench.profile_spark``.

On the benchmark's DataFrame (``--rows`` rows, cached, Spark ``local[2]``), in a fresh migrated
PostgreSQL database, times:

- ``jdbc``: Spark's own JDBC writer into a plain table, and into a table with the outbox's
  primary key and unique ``message_id`` (like for like);
- ``outbox``: the product's ``write_outbox`` (each run into an emptied outbox);
- ``copy floor``: the same rows, built beforehand in this process, COPYed by two connections at
  once (as the two tasks do) into the outbox and into the like-for-like table: what PostgreSQL
  alone needs, with no Spark at all, and so the most any writer into that table can reach here;
- ``arrow transfer``: a ``mapInArrow`` job that only counts rows (the floor of any Arrow-based
  Python writer) and ``rdd transfer``, the same over ``df.rdd`` (the floor of a Row-based one);

and, for each write, what PostgreSQL did: WAL bytes per row and tuples inserted, updated and
deleted per table (``pg_stat_user_tables``), so a second pass over every row shows up as such.
Uses only the public ``write_outbox``: it keeps working while the writer's internals change.
For a Python-level profile of the executors, run it under ``py-spy record --subprocesses``.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa

from bench.common import Services, libpq_url, temp_postgres
from bench.workloads import spark as sw

STATS = "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables"


def _snapshot(conn: psycopg.Connection[Any]) -> tuple[int, dict[str, tuple[int, ...]]]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    tables = {r[0]: tuple(int(x) for x in r[1:]) for r in conn.execute(STATS).fetchall()}
    return int(row[0]), tables


def _measure(label: str, conn: psycopg.Connection[Any], fn: Callable[[], Any], n: int) -> None:
    wal0, before = _snapshot(conn)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    time.sleep(0.7)  # table statistics reach the collector with a short delay
    wal1, after = _snapshot(conn)
    print(
        f"  {label:<24} {seconds:6.2f}s {n / seconds:>10,.0f} rows/s   "
        f"WAL {(wal1 - wal0) / n:6.0f} B/row",
        flush=True,
    )
    for table, now in sorted(after.items()):
        then = before.get(table, (0, 0, 0, 0))
        ins, upd, hot, dele = (a - b for a, b in zip(now, then, strict=True))
        if ins or upd or dele:
            print(
                f"      {table:<22} inserted {ins:>8,}  updated {upd:>8,} "
                f"(HOT {hot:,})  deleted {dele:>8,}"
            )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    n = args.rows
    tmp = Path(tempfile.mkdtemp(prefix="outbox-profile-spark-"))
    (tmp / "python").mkdir()
    (tmp / "spark").mkdir()
    with temp_postgres(Services.from_env()) as url:
        spark = sw._spark(tmp)
        spark.sparkContext.setLogLevel("ERROR")
        conn = psycopg.connect(libpq_url(url), autocommit=True)
        try:
            df = sw._frame(spark, n).cache()
            df.count()
            warm = sw._frame(spark, 1000).cache()
            sw._reset(url)
            sw._write_jdbc(warm, url)
            sw._write_jdbc_keys(warm, url, 0)
            sw._write_outbox(warm, url, batch=0)
            floor = sw.copy_data(n)
            print(f"{n:,} rows, Spark local[2], PostgreSQL:")
            for i in range(args.repeats):
                sw._reset(url)
                _measure("jdbc (plain table)", conn, lambda: sw._write_jdbc(df, url), n)
                sw._reset(url)
                keys = functools.partial(sw._write_jdbc_keys, df, url, i + 1)
                _measure("jdbc (same keys)", conn, keys, n)
                sw._reset(url)
                write = functools.partial(sw._write_outbox, df, url, batch=i + 1)
                _measure("write_outbox", conn, write, n)
                sw._reset(url)
                _measure("copy floor (outbox)", conn, lambda: sw.copy_rows(url, "outbox", floor), n)
                sw._reset(url)
                same = functools.partial(sw.copy_rows, url, sw.JDBC_KEYS_TABLE, floor)
                _measure("copy floor (same keys)", conn, same, n)
                _measure("arrow transfer (count)", conn, lambda: _arrow_count(df), n)
                _measure("rdd transfer (count)", conn, lambda: _rdd_count(df), n)
        finally:
            conn.close()
            spark.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _arrow_count(df: Any) -> None:

    def count(batches: Any) -> Any:
        total = sum(b.num_rows for b in batches)
        yield pa.RecordBatch.from_pydict({"n": [total]})

    df.mapInArrow(count, "n long").collect()


def _rdd_count(df: Any) -> None:
    df.rdd.mapPartitions(lambda rows: [sum(1 for _ in rows)]).collect()


if __name__ == "__main__":
    sys.exit(main())
