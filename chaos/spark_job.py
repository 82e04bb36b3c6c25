"""The Spark driver of scenario 13: ``python -m chaos.spark_job --url … --input … --checkpoint …``.

Structured Streaming over JSON files (one file per micro-batch), written through ``OutboxSink``
in ``foreachBatch``, ``availableNow`` (stops when the input is consumed). Marker files tell the
runner where the job is; ``--hold-batch N --hold S`` makes each task of batch N wait S seconds
after its partition committed, so the runner can kill the driver in the middle of that write.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any


class Marker:
    """``on_partition_committed`` hook (runs in the executor): leave a file, maybe wait."""

    def __init__(self, directory: str, batch_id: int, hold: float) -> None:
        self.directory = directory
        self.batch_id = batch_id
        self.hold = hold

    def __call__(self, result: Any) -> None:
        name = f"batch-{self.batch_id}.p{result.partition}.a{result.attempt}.committed"
        Path(self.directory, name).write_text(f"{result.inserted} {result.rows}\n")
        if self.hold > 0:
            time.sleep(self.hold)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.spark_job")
    parser.add_argument("--url", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--markers", required=True)
    parser.add_argument("--sink", required=True)
    parser.add_argument("--exchange", required=True)
    parser.add_argument("--routing-key", default="rk")
    parser.add_argument("--hold-batch", type=int, default=-1)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--standby-wait", type=float, default=None)
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import DataFrame, SparkSession

    from chaos.spark_job import Marker as Hook  # by reference, so the workers import it
    from spark_writer import OutboxSink

    work = Path(args.checkpoint).parent
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("chaos-spark-13")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.files.maxPartitionBytes", "65536")
        .config("spark.sql.files.openCostInBytes", "0")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.warehouse.dir", str(work / "warehouse"))
        .config("spark.local.dir", str(work / "tmp"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    markers = args.markers

    def write(df: DataFrame, batch_id: int) -> None:
        Path(markers, f"batch-{batch_id}.start").touch()
        hold = args.hold if batch_id == args.hold_batch else 0.0
        sink = OutboxSink(
            url=args.url,
            sink=args.sink,
            exchange=args.exchange,
            routing_key=args.routing_key,
            body_column="payload",
            on_partition_committed=Hook(markers, batch_id, hold),
            **({} if args.standby_wait is None else {"standby_wait": args.standby_wait}),
        )
        result = sink(df, batch_id)
        Path(markers, f"batch-{batch_id}.done").write_text(f"{result}\n")

    stream = (
        spark.readStream.schema("n LONG, payload STRING")
        .option("maxFilesPerTrigger", 1)
        .json(args.input)
    )
    query = (
        stream.writeStream.foreachBatch(write)
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
