"""Pure tests of the Spark writer: options, schema checks, the rules, the Arrow mapping and the
COPY encoder. No SparkSession, no database."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import struct
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from spark_writer import OutboxConfigError, OutboxOptions, OutboxSchemaError
from spark_writer.envelope import ArrowMapper, BatchRef, Chunk, content_message_id, jsonable
from spark_writer.options import from_spark_options
from spark_writer.pgcopy import Const, encode
from spark_writer.rules import checks
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
ARROW = pa.schema(
    [
        ("id", pa.int64()),
        ("region", pa.string()),
        ("payload", pa.string()),
        ("tenant", pa.string()),
        ("score", pa.float64()),
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


def mapper(options: OutboxOptions, schema: StructType = SCHEMA, partition: int = 0) -> ArrowMapper:
    return ArrowMapper(options=options, schema=schema, batch=BATCH, partition=partition)


def batch(*rows: tuple[Any, ...], arrow: pa.Schema = ARROW) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([dict(zip(arrow.names, r, strict=True)) for r in rows], arrow)


def single(
    m: ArrowMapper, row: tuple[Any, ...], arrow: pa.Schema = ARROW, start: int = 0
) -> dict[str, Any]:
    """The one mapped row as {outbox column: value}, constants included."""
    chunk = m.map(batch(row, arrow=arrow), start)
    assert chunk.rows == 1 and not chunk.rejected
    return rows_of(m, chunk)[0]


def rows_of(m: ArrowMapper, chunk: Chunk) -> list[dict[str, Any]]:
    columns = [c.to_pylist() for c in chunk.columns]
    constant = dict(m.layout.constant)
    return [
        constant | dict(zip(m.layout.varying, values, strict=True))
        for values in zip(*columns, strict=True)
    ]


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


# --- rules ---------------------------------------------------------------------------------


def test_checks_come_in_order_and_only_where_they_apply() -> None:
    options = opts(
        exchange=None,
        exchange_column="tenant",
        body_column="payload",
        message_id_column="id",
        header_columns=("tenant", "score"),
        max_body_bytes=9,
    )
    assert [c.summary for c in checks(SCHEMA, options)] == [
        "column 'id' (message id) is null",  # an integer key cannot be empty or too long
        "column 'tenant' (exchange) is null",
        "column 'tenant' (exchange) is longer than 255 bytes",
        "column 'region' (routing key) is null",
        "column 'region' (routing key) is longer than 255 bytes",
        "column 'payload' (body) is null",
        "column 'payload' (body) is over the 9-byte maximum",
        "header column 'score' is NaN or infinite",
        "column 'tenant' (header) is longer than 61440 bytes",  # its share of the header limit
    ]
    assert [c.summary for c in checks(SCHEMA, opts(max_body_bytes=9))][-2:] == [
        "row JSON (body) holds NaN or infinity, which JSON cannot carry",
        "row JSON (body) is over the 9-byte maximum",
    ]


# --- Arrow mapping ---------------------------------------------------------------------------


def test_row_without_body_column_becomes_json_with_derived_id() -> None:
    out = single(mapper(opts()), (1, "eu", "p", "t1", 0.5), start=3)
    assert json.loads(out["body"]) == {
        "id": 1,
        "region": "eu",
        "payload": "p",
        "tenant": "t1",
        "score": 0.5,
    }
    assert out["content_type"] == "application/json"
    assert (out["routing_key"], out["exchange"], out["mandatory"]) == ("eu", "ex", True)
    assert out["batch_id"] == "orders:7"
    digest = hashlib.sha256(out["body"]).hexdigest()  # the row's JSON is the body here
    assert out["message_id"] == f"orders:7:{digest[:32]}:0"
    # the mapper's column-wise ids are the documented formula's
    assert out["message_id"] == content_message_id(
        sink="orders", spark_batch_id=7, digest=digest, occurrence=0
    )


def test_ids_without_a_key_come_from_content_not_position() -> None:
    """The data source's ids: the same rows give the same ids whatever partition or position
    they sit at; identical rows are told apart by their occurrence in the partition."""
    rows = [(i % 3, "eu", "p", "t", 0.5) for i in range(6)]  # three rows, each twice
    first = rows_of(m := mapper(opts(body_column="payload")), m.map(batch(*rows), 0))
    again = mapper(opts(body_column="payload"), partition=1)
    shuffled = rows_of(again, again.map(batch(*reversed(rows)), 40))
    assert sorted(r["message_id"] for r in first) == sorted(r["message_id"] for r in shuffled)
    assert len({r["message_id"] for r in first}) == 6
    assert {r["message_id"].rsplit(":", 1)[1] for r in first} == {"0", "1"}
    assert all(r["message_id"].startswith("orders:7:") for r in first)


def test_body_columns_headers_key_and_ordering_key() -> None:
    options = opts(
        body_column="payload",
        message_id_column="id",
        header_columns=("tenant", "score"),
        ordering_key_column="tenant",
    )
    out = single(mapper(options), (42, "eu", "héllo", "t1", None))
    assert out["body"] == "héllo".encode()
    assert out["content_type"] == "text/plain; charset=utf-8"
    assert out["message_id"] == "42"
    assert json.loads(out["headers"]) == {"tenant": "t1"}  # null headers are left out
    assert out["ordering_key"] == "t1"


def test_binary_body_is_octets_and_content_type_can_be_set() -> None:
    schema = StructType([StructField("region", StringType()), StructField("b", BinaryType())])
    arrow = pa.schema([("region", pa.string()), ("b", pa.binary())])
    out = single(mapper(opts(body_column="b"), schema), ("eu", b"\x00\x01"), arrow)
    assert out["body"] == b"\x00\x01"
    assert out["content_type"] == "application/octet-stream"
    custom = mapper(opts(body_column="b", content_type="application/x-protobuf"), schema)
    assert single(custom, ("eu", b"x"), arrow)["content_type"] == "application/x-protobuf"


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
            opts(),
            (1, "é" * 128, "p", "t", 1.0),
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
            "body is 61 bytes, over the 10-byte maximum",
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
            "header column 'score' is NaN or infinite",
        ),
        (
            opts(),
            (1, "eu", "p", "t", float("inf")),
            "row JSON (body) holds NaN or infinity, which JSON cannot carry",
            "row JSON (body) holds NaN or infinity, which JSON cannot carry",
        ),
    ],
)
def test_bad_rows_are_rejected_naming_column_and_problem(
    options: OutboxOptions, row: tuple[Any, ...], summary: str, detail: str
) -> None:
    chunk = mapper(options, partition=1).map(batch(row), 9)
    assert chunk.rows == 0 and all(len(c) == 0 for c in chunk.columns)
    [out] = chunk.rejected
    assert (out.problem.summary, out.problem.detail) == (summary, detail)
    assert out.position == 9
    if options.message_id_column is None:  # a content id, like a fit row's
        assert out.message_id.startswith("orders:7:") and out.message_id.endswith(":0")
    else:
        assert out.message_id == ""
    assert json.loads(out.row_json.replace("NaN", "null").replace("Infinity", "null"))["id"] == 1


def test_a_batch_keeps_its_fit_rows_in_order_with_their_own_positions() -> None:
    rows = [(i, None if i in (1, 4) else f"r{i}", f"p{i}", "t", 0.0) for i in range(6)]
    m = mapper(opts(body_column="payload"))
    chunk = m.map(batch(*rows), 100)
    assert chunk.rows == 4
    assert [(r["routing_key"], r["body"]) for r in rows_of(m, chunk)] == [
        (f"r{i}", f"p{i}".encode()) for i in (0, 2, 3, 5)
    ]
    assert [r.position for r in chunk.rejected] == [101, 104]
    ids = [r["message_id"] for r in rows_of(m, chunk)] + [r.message_id for r in chunk.rejected]
    assert len(set(ids)) == 6 and all(i.startswith("orders:7:") for i in ids)


def test_json_body_of_nested_values() -> None:
    schema = StructType(
        [
            StructField("k", IntegerType()),
            StructField("region", StringType()),
            StructField("m", MapType(StringType(), IntegerType())),
            StructField("a", ArrayType(DoubleType())),
        ]
    )
    arrow = pa.schema(
        [
            ("k", pa.int32()),
            ("region", pa.string()),
            ("m", pa.map_(pa.string(), pa.int32())),
            ("a", pa.list_(pa.float64())),
        ]
    )
    m = mapper(opts(message_id_column="k"), schema)
    out = single(m, (5, "eu", [("a", 1)], [0.5]), arrow)
    assert out["message_id"] == "5"
    assert json.loads(out["body"]) == {"k": 5, "region": "eu", "m": {"a": 1}, "a": [0.5]}
    [bad] = m.map(batch((6, "eu", [], [float("nan")]), arrow=arrow), 0).rejected
    assert bad.problem.summary.startswith("row JSON (body) holds NaN")


def test_jsonable_converts_nested_arrow_values() -> None:
    value = {
        "m": {"k": 1},
        "s": {"x": Decimal("1.50"), "b": b"\x00"},
        "a": [dt.date(2024, 1, 2)],
        "t": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "d": dt.timedelta(seconds=90),
    }
    assert jsonable(value) == {
        "m": {"k": 1},
        "s": {"x": "1.50", "b": "AA=="},
        "a": ["2024-01-02"],
        "t": "2024-01-02T03:04:05+00:00",
        "d": 90.0,
    }


# --- binary COPY -----------------------------------------------------------------------------


def decode_copy(data: bytes) -> list[list[bytes | None]]:
    """PostgreSQL binary COPY rows (no header) back into fields."""
    rows, at = [], 0
    while at < len(data):
        (count,) = struct.unpack_from(">h", data, at)
        at += 2
        fields: list[bytes | None] = []
        for _ in range(count):
            (size,) = struct.unpack_from(">i", data, at)
            at += 4
            fields.append(None if size < 0 else data[at : at + size])
            at += max(size, 0)
        rows.append(fields)
    return rows


def test_copy_rows_carry_lengths_nulls_and_constants() -> None:
    keys = pa.array(["a", None, "ccc", "dé"]).slice(1)  # an offset into the buffers
    bodies = pa.array([b"x", b"\x00\x01", None, b""], pa.binary()).slice(1)
    data = encode([keys, Const.of("b:1"), Const.of(True), bodies, Const.of(None)])
    assert decode_copy(data.to_pybytes()) == [
        [None, b"b:1", b"\x01", b"\x00\x01", None],
        [b"ccc", b"b:1", b"\x01", None, None],
        ["dé".encode(), b"b:1", b"\x01", b"", None],
    ]
