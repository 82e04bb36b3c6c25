"""What several Spark test modules share: the orders schema and frames, the sink's options, a
stream awaited with a bound, order files for a file stream, a UDF that fails on one row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import (
    LongType,
    StringType,
    StructField,
    StructType,
)

ORDERS = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("payload", StringType()),
        StructField("tenant", StringType()),
    ]
)


STREAM_TIMEOUT = 120


def orders(spark: SparkSession, n: int, bad: dict[int, dict[str, Any]] | None = None) -> DataFrame:
    """``n`` rows in two partitions (rows 0..n/2-1 in the first); ``bad`` overrides some rows."""
    rows = []
    for i in range(n):
        row = {"id": i, "region": f"r{i % 3}", "payload": f"order {i}", "tenant": f"t{i % 2}"}
        row.update((bad or {}).get(i, {}))
        rows.append(tuple(row[f] for f in ORDERS.fieldNames()))
    return spark.createDataFrame(rows, ORDERS).coalesce(2)


def sink_options(url: str, **kw: Any) -> dict[str, Any]:
    base = {
        "url": url,
        "sink": "orders",
        "exchange": "orders.x",
        "routing_key_column": "region",
        "body_column": "payload",
    }
    return base | kw


def await_stream(query: StreamingQuery) -> None:
    finished = query.awaitTermination(STREAM_TIMEOUT)
    if query.exception() is not None:
        raise AssertionError(f"stream failed: {query.exception()}")
    assert finished, f"stream did not finish within {STREAM_TIMEOUT}s"


def write_order_files(directory: Path, files: int, per_file: int) -> list[dict[str, Any]]:
    directory.mkdir(parents=True, exist_ok=True)
    docs = []
    for f in range(files):
        chunk = [
            {
                "id": f * per_file + i,
                "region": f"r{i % 3}",
                "payload": f"order {f}-{i}",
                "tenant": f"t{i % 2}",
            }
            for i in range(per_file)
        ]
        (directory / f"part-{f:03d}.json").write_text("\n".join(json.dumps(d) for d in chunk))
        docs += chunk
    return docs


def fail_on_row_25(payload: str) -> str:
    if payload == "order 25":
        raise RuntimeError("injected: row 25 cannot be computed")
    return payload
