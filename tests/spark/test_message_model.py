"""The message a Kafka or RabbitMQ user expects, per row: headers (a map, or Kafka's key/value
array), content type, persistent or transient, priority, expiration, correlation id, type,
app id, reply-to and timestamp; each validated like the other columns and carried to the
publish (checked on a real broker through the real publisher)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from typing import Any

import aio_pika
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from app.db import make_engine
from spark_writer import OutboxConfigError, OutboxDataError, OutboxSchemaError, write_outbox
from tests.support import dbview
from tests.support.publisher import (
    all_in,
    declare,
    delete,
    running_publisher,
    settings_for,
    wait_rows,
)

pytestmark = pytest.mark.spark

AT = dt.datetime(2026, 11, 24, 12, 30, tzinfo=dt.UTC)
SCHEMA = StructType(
    [
        StructField("id", StringType()),
        StructField("payload", StringType()),
        StructField("attrs", MapType(StringType(), StringType())),
        StructField("ctype", StringType()),
        StructField("prio", IntegerType()),
        StructField("ttl_ms", LongType()),
        StructField("corr", StringType()),
        StructField("kind", StringType()),
        StructField("at", TimestampType()),
    ]
)
KAFKA = StructType(
    [
        StructField("id", StringType()),
        StructField("payload", StringType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)
PROPERTIES = {
    "priority": "prio",
    "expiration": "ttl_ms",
    "correlation_id": "corr",
    "type": "kind",
    "timestamp": "at",
}


def rows(spark: SparkSession, n: int, bad: dict[int, dict[str, Any]] | None = None) -> DataFrame:
    out = []
    for i in range(n):
        row = {
            "id": f"m{i}",
            "payload": f"body {i}",
            "attrs": {"tenant": f"t{i % 2}"},
            "ctype": "text/csv" if i % 2 else None,
            "prio": i % 10,
            "ttl_ms": 60_000,
            "corr": f"c{i}",
            "kind": "order.created",
            "at": AT,
        }
        row.update((bad or {}).get(i, {}))
        out.append(tuple(row[f] for f in SCHEMA.fieldNames()))
    return spark.createDataFrame(out, SCHEMA).coalesce(2)


def options(url: str, **kw: Any) -> dict[str, Any]:
    base = {
        "url": url,
        "sink": "mm",
        "exchange": "mm.x",
        "routing_key": "rk",
        "body_column": "payload",
        "message_id_column": "id",
        "headers_column": "attrs",
        "header_columns": ["kind"],
        "content_type_column": "ctype",
        "property_columns": PROPERTIES,
        "persistent": False,
    }
    return base | kw


@pytest.mark.spark_api
def test_every_message_attribute_lands_in_the_outbox_row(spark: SparkSession, db_url: str) -> None:
    result = write_outbox(rows(spark, 4), batch_id=1, **options(db_url))
    assert result.written == 4
    by_id = {r["message_id"]: r for r in dbview.outbox(db_url)}
    m1, m0 = by_id["m1"], by_id["m0"]
    assert m1["headers"] == {"tenant": "t1", "kind": "order.created"}
    assert (m1["content_type"], m0["content_type"]) == ("text/csv", "text/plain; charset=utf-8")
    assert props(m1) == {
        "delivery_mode": 1,
        "priority": 1,
        "expiration": 60000,
        "correlation_id": "c1",
        "type": "order.created",
        "timestamp": "2026-11-24T12:30:00+00:00",
    }

    # the same through format("outbox"), its options as strings (new ids: ids are one namespace)
    (
        rows(spark, 4)
        .withColumn("id", F.concat(F.lit("ds-"), "id"))
        .write.format("outbox")
        .mode("append")
        .options(url=db_url, sink="mm-ds", batchId="1", exchange="mm.x", routingKey="rk")
        .options(
            bodyColumn="payload",
            headersColumn="attrs",
            headerColumns="kind",
            contentTypeColumn="ctype",
            persistent="false",
            propertyColumns=",".join(f"{p}={c}" for p, c in PROPERTIES.items()),
        )
        .options(messageIdColumn="id")
        .save()
    )
    ds = {r["message_id"]: r for r in dbview.outbox(db_url) if r["batch_id"] == "mm-ds:1"}
    for key, row in by_id.items():
        twin = ds[f"ds-{key}"]
        assert (twin["headers"], twin["content_type"], props(twin)) == (
            row["headers"],
            row["content_type"],
            props(row),
        )


def props(row: dict[str, Any]) -> Any:
    value = row["properties"]
    return json.loads(value) if isinstance(value, str) else value


@pytest.mark.spark_api
def test_kafka_headers_are_decoded_and_bad_values_are_refused_or_rejected(
    spark: SparkSession, db_url: str
) -> None:
    data = [
        ("k0", "b0", [("trace", b"abc"), ("tenant", b"t0")]),
        ("k1", "b1", [("trace", b"\xff\xfe")]),  # not UTF-8
        ("k2", "b2", [("x-outbox-id", b"forged")]),  # the publisher's own header
        ("k3", "b3", None),
    ]
    df = spark.createDataFrame(data, KAFKA).coalesce(1)
    kw = {
        "url": db_url,
        "sink": "kafka",
        "exchange": "x",
        "routing_key": "rk",
        "body_column": "payload",
        "message_id_column": "id",
        "headers_column": "headers",
    }
    with pytest.raises(OutboxDataError) as err:
        write_outbox(df, batch_id=1, **kw)
    text = str(err.value)
    assert "column 'headers' (headers) has a header value that is not UTF-8: 1 row" in text
    assert "one the publisher sets itself" in text and "nothing written" in text
    assert dbview.count(db_url, "outbox") == 0
    result = write_outbox(df, batch_id=2, on_invalid="reject", **kw)
    assert (result.written, result.rejected) == (2, 2)
    by_id = {r["message_id"]: r for r in dbview.outbox(db_url)}
    assert by_id["k0"]["headers"] == {"trace": "abc", "tenant": "t0"}
    assert by_id["k3"]["headers"] == {}
    assert {r["message_id"] for r in dbview.rejects(db_url)} == {"k1", "k2"}


@pytest.mark.spark_api
def test_bad_property_values_name_the_column_and_the_rest_is_written(
    spark: SparkSession, db_url: str
) -> None:
    bad = {1: {"prio": 300}, 2: {"ttl_ms": -5}, 3: {"corr": "c" * 256}}
    df = rows(spark, 8, bad)
    with pytest.raises(OutboxDataError) as err:
        write_outbox(df, batch_id=1, **options(db_url))
    text = str(err.value)
    assert "column 'prio' (priority) is outside 0..255: 1 row(s), first: prio is 300" in text
    assert "(message id m1)" in text
    assert "column 'ttl_ms' (expiration) is outside 0..4294967295: 1 row(s)" in text
    assert "column 'corr' (correlation id) is longer than 255 bytes: 1 row(s)" in text
    result = write_outbox(df, batch_id=2, on_invalid="reject", **options(db_url))
    assert (result.written, result.rejected) == (5, 3)
    reasons = {r["message_id"]: r["reason"] for r in dbview.rejects(db_url)}
    assert reasons["m1"] == "prio is 300, outside 0..255"
    assert reasons["m2"] == "ttl_ms is -5, outside 0..4294967295"


@pytest.mark.spark_api
def test_schema_and_option_errors_for_the_message_columns(
    spark: SparkSession, sqlite_url: str
) -> None:
    df = rows(spark, 2).withColumn("prio", F.col("corr"))
    with pytest.raises(OutboxSchemaError, match=r"column 'prio' \(priority\) has type string"):
        write_outbox(df, batch_id=1, **options(sqlite_url))
    nested = rows(spark, 2).selectExpr("*", "map('a', array(1)) AS deep")
    with pytest.raises(OutboxSchemaError, match=r"column 'deep' \(headers\) has type map"):
        write_outbox(nested, batch_id=1, **options(sqlite_url, headers_column="deep"))
    with pytest.raises(OutboxConfigError, match=r"unknown properties \['colour'\]"):
        write_outbox(df, batch_id=1, **options(sqlite_url, property_columns={"colour": "x"}))
    with pytest.raises(
        OutboxConfigError,
        match=r"content_type \(one for the batch\) or content_type_column, not both",
    ):
        write_outbox(df, batch_id=1, **options(sqlite_url, content_type="a/b"))


async def test_the_broker_delivers_every_attribute_the_row_carried(
    spark: SparkSession, pg_url: str, amqp_url: str
) -> None:
    name = f"test-mm-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=name, queue=name)
    try:
        write_outbox(rows(spark, 4), batch_id=1, **options(pg_url, exchange=name))
        engine = make_engine(pg_url)
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url)
        async with running_publisher(settings, engine):
            await wait_rows(engine, all_in("confirmed"))
        engine.dispose()
        conn = await aio_pika.connect(amqp_url)
        async with conn:
            channel = await conn.channel()
            queue = await channel.get_queue(name, ensure=False)
            got = {}
            for _ in range(4):
                message = await queue.get(timeout=10)
                assert message is not None
                got[message.message_id] = message
                await message.ack()
        m1, m0 = got["m1"], got["m0"]
        assert m1.body == b"body 1" and m1.content_type == "text/csv"
        assert m0.content_type == "text/plain; charset=utf-8"
        assert (m1.priority, m1.correlation_id, m1.type) == (1, "c1", "order.created")
        assert m1.expiration is not None and float(m1.expiration) == pytest.approx(60.0)
        assert m1.delivery_mode == aio_pika.DeliveryMode.NOT_PERSISTENT
        stamp = m1.timestamp
        assert stamp is not None and stamp.replace(tzinfo=stamp.tzinfo or dt.UTC) == AT
        assert m1.headers["tenant"] == "t1" and m1.headers["kind"] == "order.created"
        assert "x-outbox-attempt" in m1.headers
    finally:
        await delete(amqp_url, exchanges=(name,), queues=(name,))
        await asyncio.sleep(0)
