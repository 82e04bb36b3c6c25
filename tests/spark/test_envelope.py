"""Pure tests of options, schema checks and the row mapping: no SparkSession, no database."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

import pytest
from pyspark.sql import Row
from pyspark.sql.types import (
    BinaryType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from spark_writer import OutboxConfigError, OutboxOptions, OutboxSchemaError, derive_message_id
from spark_writer.envelope import BatchRef, Envelope, Rejected, RowMapper, jsonable
from spark_writer.options import from_spark_options
from spark_writer.validate import check_schema

URL = "sqlite:////tmp/outbox-unit.db"
SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("payload", StringType()),
        StructField("tenant", StringType()),
        StructField("score", DoubleType()),
    ]
)
BATCH = BatchRef(sink="orders", spark_batch_id=7)


def opts(**kw: Any) -> OutboxOptions:
    base: dict[str, Any] = {
        "url": URL,
        "sink": "orders",
        "exchange": "ex",
        "routing_key_column": "region",
    }
    return OutboxOptions(**(base | kw))


def mapper(options: OutboxOptions, schema: StructType = SCHEMA, partition: int = 0) -> RowMapper:
    return RowMapper(options=options, schema=schema, batch=BATCH, partition=partition)


# --- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"exchange_column": "x"}, "exactly one of exchange and exchange_column"),
        ({"routing_key": "rk"}, "exactly one of routing_key and routing_key_column"),
        ({"url": "mysql://x/y"}, "url must be"),
        ({"url": "sqlite://"}, "url must be"),
        ({"sink": "bad name"}, "sink 'bad name'"),
        ({"exchange": "e" * 256}, "exchange is longer than 255 bytes"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"on_invalid": "skip"}, "on_invalid"),
    ],
)
def test_bad_options_are_refused_with_the_reason(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(OutboxConfigError, match=needle):
        opts(**kw)


def test_spark_options_accept_camel_and_snake_case() -> None:
    raw = {
        "URL": URL,
        "sink": "s",
        "exchange": "",
        "routing_key_column": "region",
        "headerColumns": "tenant, score",
        "MANDATORY": "false",
        "maxBodyBytes": "10",
        "onInvalid": "reject",
        "batchId": "42",
        "checkpointLocation": "/tmp/cp",
    }
    options, batch_id = from_spark_options(raw)
    assert batch_id == 42
    assert options.header_columns == ("tenant", "score")
    assert options.mandatory is False
    assert options.max_body_bytes == 10
    assert options.on_invalid == "reject"
    assert options.exchange == ""


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            {"url": URL, "sink": "s", "exchange": "e", "routingKey": "r", "rootingKey": "x"},
            "unknown outbox option 'rootingKey'",
        ),
        ({"sink": "s", "exchange": "e", "routingKey": "r"}, "'url' is required"),
        (
            {"url": URL, "sink": "s", "exchange": "e", "routingKey": "r", "mandatory": "yes"},
            "true or false",
        ),
        ({"url": URL, "sink": "s", "exchange": "e", "routingKey": "r", "batchId": "x"}, "integer"),
    ],
)
def test_bad_spark_options_name_the_option(raw: dict[str, str], needle: str) -> None:
    with pytest.raises(OutboxConfigError, match=needle):
        from_spark_options(raw)


# --- schema ----------------------------------------------------------------------------------


def test_schema_problems_name_every_column_and_its_problem() -> None:
    options = opts(routing_key_column="Region", body_column="id", header_columns=("nope",))
    with pytest.raises(OutboxSchemaError) as err:
        check_schema(SCHEMA, options)
    assert err.value.problems == (
        "column 'Region' (routing key) not found (did you mean 'region'?)",
        "column 'id' (body) has type bigint; expected binary or string",
        "column 'nope' (header) not found; columns are ['id', 'region', 'payload', 'tenant', "
        "'score']",
    )


def test_schema_accepts_fitting_types() -> None:
    check_schema(
        SCHEMA,
        opts(
            body_column="payload",
            message_id_column="id",
            header_columns=("tenant", "score"),
            ordering_key_column="tenant",
        ),
    )


# --- row mapping -----------------------------------------------------------------------------


def test_row_without_body_column_becomes_json_with_derived_id() -> None:
    out = mapper(opts()).map((1, "eu", "p", "t1", 0.5), 3)
    assert isinstance(out, Envelope)
    assert json.loads(out.body) == {
        "id": 1,
        "region": "eu",
        "payload": "p",
        "tenant": "t1",
        "score": 0.5,
    }
    assert out.content_type == "application/json"
    assert out.routing_key == "eu" and out.exchange == "ex" and out.mandatory is True
    assert out.message_id == derive_message_id(
        sink="orders", spark_batch_id=7, partition=0, position=3
    )


def test_derived_ids_are_stable_and_distinct_per_position() -> None:
    ids = {
        derive_message_id(sink="s", spark_batch_id=b, partition=p, position=i)
        for b in (1, 2)
        for p in (0, 1)
        for i in range(50)
    }
    assert len(ids) == 200
    assert derive_message_id(
        sink="s", spark_batch_id=1, partition=0, position=0
    ) == derive_message_id(sink="s", spark_batch_id=1, partition=0, position=0)


def test_body_columns_headers_key_and_ordering_key() -> None:
    options = opts(
        body_column="payload",
        message_id_column="id",
        header_columns=("tenant", "score"),
        ordering_key_column="tenant",
    )
    out = mapper(options).map((42, "eu", "héllo", "t1", None), 0)
    assert isinstance(out, Envelope)
    assert out.body == "héllo".encode()
    assert out.content_type == "text/plain; charset=utf-8"
    assert out.message_id == "42"
    assert json.loads(out.headers or "") == {"tenant": "t1"}  # null headers are left out
    assert out.ordering_key == "t1"


def test_binary_body_is_octets_and_content_type_can_be_set() -> None:
    schema = StructType([StructField("region", StringType()), StructField("b", BinaryType())])
    out = mapper(opts(body_column="b"), schema).map(("eu", bytearray(b"\x00\x01")), 0)
    assert isinstance(out, Envelope) and out.body == b"\x00\x01"
    assert out.content_type == "application/octet-stream"
    out = mapper(opts(body_column="b", content_type="application/x-protobuf"), schema).map(
        ("eu", b"x"), 0
    )
    assert isinstance(out, Envelope) and out.content_type == "application/x-protobuf"


@pytest.mark.parametrize(
    ("options", "row", "summary", "detail"),
    [
        (
            opts(),
            (1, None, "p", "t", 1.0),
            "column 'region' (routing key) is null",
            "region is null",
        ),
        (
            opts(),
            (1, "r" * 256, "p", "t", 1.0),
            "column 'region' (routing key) is longer than 255 bytes",
            "region is 256 bytes, over the 255-byte limit",
        ),
        (
            opts(body_column="payload"),
            (1, "eu", None, "t", 1.0),
            "column 'payload' (body) is null",
            "payload is null",
        ),
        (
            opts(body_column="payload", max_body_bytes=4),
            (1, "eu", "12345", "t", 1.0),
            "column 'payload' (body) is over the 4-byte maximum",
            "body is 5 bytes, over the 4-byte maximum",
        ),
        (
            opts(max_body_bytes=10),
            (1, "eu", "p", "t", 1.0),
            "row JSON (body) is over the 10-byte maximum",
            None,
        ),
        (
            opts(exchange=None, exchange_column="tenant"),
            (1, "eu", "p", None, 1.0),
            "column 'tenant' (exchange) is null",
            "tenant is null",
        ),
        (
            opts(message_id_column="payload"),
            (1, "eu", "", "t", 1.0),
            "column 'payload' (message id) is empty",
            "payload is empty",
        ),
        (
            opts(body_column="payload", header_columns=("score",)),
            (1, "eu", "p", "t", float("nan")),
            "header column 'score' is NaN or infinite",
            None,
        ),
        (
            opts(),
            (1, "eu", "p", "t", float("inf")),
            "row JSON (body) holds NaN or infinity, which JSON cannot carry",
            None,
        ),
    ],
)
def test_bad_rows_are_rejected_naming_column_and_problem(
    options: OutboxOptions, row: tuple[Any, ...], summary: str, detail: str | None
) -> None:
    out = mapper(options, partition=1).map(row, 9)
    assert isinstance(out, Rejected)
    assert out.problem.summary == summary
    if detail is not None:
        assert out.problem.detail == detail
    assert out.position == 9
    assert json.loads(out.row_json.replace("NaN", "null").replace("Infinity", "null"))["id"] == 1


def test_jsonable_converts_nested_spark_values() -> None:
    inner = Row("x", "b")(Decimal("1.50"), b"\x00")
    value = {
        "m": {"k": 1},
        "s": inner,
        "a": [dt.date(2024, 1, 2)],
        "t": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    }
    assert jsonable(value) == {
        "m": {"k": 1},
        "s": {"x": "1.50", "b": "AA=="},
        "a": ["2024-01-02"],
        "t": "2024-01-02T03:04:05+00:00",
    }


def test_map_and_int_key_columns() -> None:
    schema = StructType(
        [
            StructField("k", IntegerType()),
            StructField("region", StringType()),
            StructField("m", MapType(StringType(), IntegerType())),
        ]
    )
    out = mapper(opts(message_id_column="k"), schema).map((5, "eu", {"a": 1}), 0)
    assert isinstance(out, Envelope)
    assert out.message_id == "5"
    assert json.loads(out.body) == {"k": 5, "region": "eu", "m": {"a": 1}}
