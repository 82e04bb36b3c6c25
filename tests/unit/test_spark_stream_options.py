"""The Spark writer's stream destination, pure: options, the data source's keys, the outbox
columns a stream batch writes, and the per-row stream name checks, which must take and refuse
exactly what ``app.streams.names.check_stream_name`` does. No SparkSession, no database."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from app.streams.names import StreamNameError, check_stream_name
from spark_writer import OutboxConfigError, OutboxOptions, OutboxSchemaError
from spark_writer.envelope import ArrowMapper, BatchRef
from spark_writer.options import from_spark_options
from spark_writer.rules import checks
from spark_writer.validate import check_schema

URL = "sqlite:////tmp/outbox-unit.db"
SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("target", StringType()),
        StructField("payload", StringType()),
    ]
)
ARROW = pa.schema([("id", pa.int64()), ("target", pa.string()), ("payload", pa.string())])
BATCH = BatchRef(sink="orders", spark_batch_id=3)


def opts(**kw: Any) -> OutboxOptions:
    return OutboxOptions(**({"url": URL, "sink": "orders", "body_column": "payload"} | kw))


def mapped(options: OutboxOptions, targets: list[str | None]) -> tuple[list[dict[str, Any]], Any]:
    """Rows ``(i, targets[i], "p{i}")`` through the mapper: (outbox rows, rejected)."""
    m = ArrowMapper(options=options, schema=SCHEMA, batch=BATCH, partition=0)
    rows = [{"id": i, "target": t, "payload": f"p{i}"} for i, t in enumerate(targets)]
    chunk = m.map(pa.RecordBatch.from_pylist(rows, ARROW), 0)
    constant = dict(m.layout.constant)
    columns = [c.to_pylist() for c in chunk.columns]
    out = [
        constant | dict(zip(m.layout.varying, values, strict=True))
        for values in zip(*columns, strict=True)
    ]
    return out, chunk.rejected


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"stream": "s", "exchange": "x"}, "an exchange or to a stream, not both: give stream "),
        (
            {"stream_column": "target", "routing_key_column": "target"},
            "give stream_column without routing_key_column",
        ),
        ({"stream": "s", "stream_column": "target"}, "exactly one of stream and stream_column"),
        ({}, "give a destination: exchange or exchange_column"),
        ({"stream": "s", "ordering_key_column": "id"}, "a stream keeps its messages in order"),
        ({"stream": ""}, "option stream: a stream name must be a non-empty string"),
        ({"stream": "amq.s"}, "names starting 'amq.' are reserved"),
        ({"stream": "s" * 256}, "at most 255 bytes"),
        ({"stream": "a\nb"}, "control characters"),
    ],
)
def test_bad_stream_options_are_refused_with_the_reason(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(OutboxConfigError, match=needle):
        opts(**kw)


def test_data_source_keys_for_a_stream_in_any_case() -> None:
    base = {"url": URL, "sink": "orders", "bodyColumn": "payload"}
    for key in ("stream", "STREAM", "Stream"):
        assert from_spark_options({**base, key: "s"})[0] == opts(stream="s")
    for key in ("streamColumn", "stream_column", "STREAMCOLUMN"):
        assert from_spark_options({**base, key: "target"})[0] == opts(stream_column="target")
    with pytest.raises(OutboxConfigError, match="not both"):
        from_spark_options({**base, "stream": "s", "exchange": "x", "routingKey": "k"})


def test_a_literal_stream_is_one_constant_and_the_exchange_is_empty() -> None:
    rows, rejected = mapped(opts(stream="events"), ["x", None])
    assert not rejected
    assert [(r["exchange"], r["routing_key"], r["stream"], r["body"]) for r in rows] == [
        ("", "", "events", b"p0"),
        ("", "", "events", b"p1"),
    ]
    assert "ordering_key" not in rows[0]


def test_a_stream_column_gives_each_row_its_stream() -> None:
    rows, rejected = mapped(opts(stream_column="target"), ["a", "b.c"])
    assert not rejected
    assert [(r["exchange"], r["routing_key"], r["stream"]) for r in rows] == [
        ("", "", "a"),
        ("", "", "b.c"),
    ]


def test_exchange_rows_write_no_stream_column() -> None:
    rows, _ = mapped(opts(exchange="x", routing_key_column="target"), ["k"])
    assert "stream" not in rows[0] and (rows[0]["exchange"], rows[0]["routing_key"]) == ("x", "k")


def test_a_bad_stream_value_rejects_its_row_only_with_the_reason() -> None:
    targets = ["ok", None, "", "s" * 256, "a\tb", "amq.x", "fine", "é" * 128]
    rows, rejected = mapped(opts(stream_column="target"), targets)
    assert [r["stream"] for r in rows] == ["ok", "fine"]
    assert [(r.position, r.problem.detail) for r in rejected] == [
        (1, "target is null"),
        (2, "target is empty"),
        (3, "target is 256 bytes, over the 255-byte limit"),
        (4, "target 'a\\tb' holds a control character"),
        (5, "target is 'amq.x': names starting 'amq.' are reserved"),
        (7, "target is 256 bytes, over the 255-byte limit"),
    ]
    assert rejected[4].problem.summary == (
        "column 'target' (stream) starts with 'amq.', a reserved prefix"
    )


NAMES = ["s", "amq", "amq.", "xamq.y", "Amq.x", "a b", "a\x00", "\x1f", "a\x7f", "\x80", "ü" * 127]
NAMES += ["ü" * 128, "s" * 255, "s" * 256, "", "tab\tname", "new\nline", "amq.stream"]


def test_the_row_checks_take_exactly_the_names_check_stream_name_takes() -> None:
    def takes(name: str) -> bool:
        try:
            check_stream_name(name)
        except StreamNameError:
            return False
        return True

    rows, rejected = mapped(opts(stream_column="target"), list(NAMES))
    refused = {NAMES[r.position] for r in rejected}
    assert {r["stream"] for r in rows} == {n for n in NAMES if takes(n)}
    assert refused == {n for n in NAMES if not takes(n)}


def test_stream_checks_and_schema() -> None:
    kinds = [(c.kind, c.column) for c in checks(SCHEMA, opts(stream_column="target"))]
    assert kinds[:5] == [
        ("null", "target"),
        ("empty", "target"),
        ("too_long", "target"),
        ("control", "target"),
        ("reserved", "target"),
    ]
    assert not [c for c in checks(SCHEMA, opts(stream="s")) if c.role == "stream"]
    with pytest.raises(OutboxSchemaError, match=r"column 'id' \(stream\) has type bigint"):
        check_schema(SCHEMA, opts(stream_column="id"))
    with pytest.raises(OutboxSchemaError, match=r"column 'zone' \(stream\) not found"):
        check_schema(SCHEMA, opts(stream_column="zone"))
