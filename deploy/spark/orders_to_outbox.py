"""A Structured Streaming job for a cluster: order events (JSON files) -> the outbox.

    spark-submit --master spark://spark-master:7077 \
      --conf spark.pyspark.python=/opt/outbox/.venv/bin/python \
      --py-files outbox_sink.zip \
      deploy/spark/orders_to_outbox.py s3a://lake/orders/ s3a://lake/checkpoints/orders-outbox

Every executor must import ``spark_writer`` (install the package in the executors' Python, or ship
it with --py-files) and reach the PostgreSQL outbox given by OUTBOX_DATABASE_URL (SQLite is for
local mode only). The checkpoint makes restarts resume; the sink makes replays add no row.
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from spark_writer import OutboxSink

SCHEMA = (
    "event_id STRING, event_type STRING, order_id STRING, customer_id STRING, "
    "amount_cents LONG, currency STRING, items INT, event_time STRING"
)


def main(source: str, checkpoint: str) -> None:
    spark = SparkSession.builder.appName("orders-to-outbox").getOrCreate()
    sink = OutboxSink(
        url=os.environ["OUTBOX_DATABASE_URL"],
        sink="orders",
        exchange="orders",
        routing_key_column="event_type",
        message_id_column="event_id",  # the business key: replays and re-sends add no row
        header_columns=["order_id"],
        ordering_key_column="order_id",
    )
    query = (
        spark.readStream.schema(SCHEMA).json(source)
        .writeStream.foreachBatch(sink)  # type: ignore[arg-type]
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime="10 seconds")
        .start()
    )  # fmt: skip
    query.awaitTermination()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
