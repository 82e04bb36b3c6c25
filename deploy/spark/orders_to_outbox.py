"""A Structured Streaming job for a cluster: order events (JSON files) -> the outbox.

    OUTBOX_DATABASE_URL=postgresql+psycopg://outbox@db.internal:5432/outbox \
    OUTBOX_PASSWORD_FILE=/etc/outbox/pg-password \
    deploy/spark/submit.sh yarn s3a://lake/orders/ s3a://lake/checkpoints/orders-outbox

Every executor must import ``spark_writer`` and its binary dependencies: ship them as a packed
virtualenv (``deploy/spark/pack-env.sh``, then ``--archives outbox-env.tar.gz#environment``), as
``deploy/spark/submit.sh`` does, or bake them into the executor image. The outbox is the
PostgreSQL database of OUTBOX_DATABASE_URL, *without* its password: OUTBOX_PASSWORD_FILE names a
file on every node (a mounted secret) that the writer reads where it connects, so the password
is never in Spark's conf, UI or event log. The checkpoint makes restarts resume; the sink makes
replays add no row. ``--once`` processes what is there and stops (a smoke test).
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


def main(source: str, checkpoint: str, once: bool = False) -> None:
    spark = SparkSession.builder.appName("orders-to-outbox").getOrCreate()
    sink = OutboxSink(
        url=os.environ["OUTBOX_DATABASE_URL"],
        sink="orders",
        exchange="orders",
        routing_key_column="event_type",
        message_id_column="event_id",  # the business key: replays and re-sends add no row
        header_columns=["order_id"],
        ordering_key_column="order_id",
        password_file=os.environ.get("OUTBOX_PASSWORD_FILE"),
    )
    query = (
        spark.readStream.schema(SCHEMA).json(source)
        .writeStream.foreachBatch(sink)  # type: ignore[arg-type]
        .option("checkpointLocation", checkpoint)
        .trigger(**({"availableNow": True} if once else {"processingTime": "10 seconds"}))
        .start()
    )  # fmt: skip
    query.awaitTermination()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], once="--once" in sys.argv[3:])
