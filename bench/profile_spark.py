"""Where the Spark → outbox write spends its time: ``python -m bench.profile_spark``.

On the benchmark's DataFrame (``--rows`` rows, cached, Spark ``local[2]``), in a fresh migrated
PostgreSQL database, times:

- ``jdbc``: Spark's own JDBC writer into a plain table (the baseline);
- ``outbox``: the product's ``write_outbox`` (each run into an emptied outbox);
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
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

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
    print(f"  {label:<24} {seconds:6.2f}s {n / seconds:>10,.0f} rows/s   "
          f"WAL {(wal1 - wal0) / n:6.0f} B/row", flush=True)  # fmt: skip
    for table, now in sorted(after.items()):
        then = before.get(table, (0, 0, 0, 0))
        ins, upd, hot, dele = (a - b for a, b in zip(now, then, strict=True))
        if ins or upd or dele:
            print(f"      {table:<22} inserted {ins:>8,}  updated {upd:>8,} "
                  f"(HOT {hot:,})  deleted {dele:>8,}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    n = args.rows
    with temp_postgres(Services.from_env()) as url:
        spark = sw._spark()
        spark.sparkContext.setLogLevel("ERROR")
        conn = psycopg.connect(libpq_url(url), autocommit=True)
        try:
            df = sw._frame(spark, n).cache()
            df.count()
            warm = sw._frame(spark, 1000).cache()
            sw._reset(url)
            sw._write_jdbc(warm, url)
            sw._write_outbox(warm, url, batch=0)
            print(f"{n:,} rows, Spark local[2], PostgreSQL:")
            for i in range(args.repeats):
                sw._reset(url)
                _measure("jdbc (plain table)", conn, lambda: sw._write_jdbc(df, url), n)
                sw._reset(url)
                write = functools.partial(sw._write_outbox, df, url, batch=i + 1)
                _measure("write_outbox", conn, write, n)
                _measure("arrow transfer (count)", conn, lambda: _arrow_count(df), n)
                _measure("rdd transfer (count)", conn, lambda: _rdd_count(df), n)
        finally:
            conn.close()
            spark.stop()
    return 0


def _arrow_count(df: Any) -> None:
    import pyarrow as pa

    def count(batches: Any) -> Any:
        total = sum(b.num_rows for b in batches)
        yield pa.RecordBatch.from_pydict({"n": [total]})

    df.mapInArrow(count, "n long").collect()


def _rdd_count(df: Any) -> None:
    df.rdd.mapPartitions(lambda rows: [sum(1 for _ in rows)]).collect()


if __name__ == "__main__":
    sys.exit(main())
