"""A streaming driver for the replay tests, run as its own process so a test can kill it.

``python -m tests.spark.replay_driver URL INPUT CHECKPOINT THREADS MAX_PARTITION_BYTES KEY
KILL_AT_ROWS``: a file stream (JSON lines) through ``OutboxSink`` with ``local[THREADS]``; with
``KILL_AT_ROWS`` > 0 the driver is killed (SIGKILL, from the executor) as soon as the committed
partitions of the first micro-batch hold that many rows, before Spark records the batch.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql.types import LongType, StringType, StructField, StructType

from spark_writer import OutboxSink, PartitionResult

SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("payload", StringType()),
    ]
)


def main() -> None:
    url, source, checkpoint, threads, max_bytes, key, kill_at = sys.argv[1:8]
    driver, ledger = os.getpid(), Path(checkpoint).with_suffix(".committed")

    def kill_when_enough(result: PartitionResult) -> None:
        """In the executor: count committed rows; past the mark, kill the driver at once."""
        if int(kill_at) <= 0:
            return
        with ledger.open("a") as out:
            out.write(f"{result.partition} {result.inserted}\n")
        committed = sum(int(line.split()[1]) for line in ledger.read_text().splitlines())
        if committed >= int(kill_at):
            os.kill(driver, signal.SIGKILL)

    spark = (
        SparkSession.builder.master(f"local[{threads}]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.files.maxPartitionBytes", max_bytes)
        .config("spark.sql.files.openCostInBytes", "1")
        .config("spark.local.dir", str(Path(checkpoint).parent / "spark-local"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    sink = OutboxSink(
        url=url,
        sink="replay",
        exchange="replay.x",
        routing_key_column="region",
        body_column="payload",
        message_id_column=key or None,
        on_partition_committed=kill_when_enough,
    )
    query = (
        spark.readStream.schema(SCHEMA)
        .json(source)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    error = query.exception()
    spark.stop()
    if error is not None:
        raise SystemExit(f"stream failed: {error}")


if __name__ == "__main__":
    main()
