"""What makes a row unfit for the outbox, as data: one ordered list of ``Check`` per batch.

Pure: a ``StructType`` and the options in, checks out. ``envelope.ArrowMapper`` evaluates the
list with pyarrow in each task; a row's problem is its first failing check.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DoubleType,
    FloatType,
    MapType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from app.outbox.content import DEFAULT_MAX_HEADER_BYTES, HEADER_NAME_MAX
from spark_writer.options import PROPERTY_ROLES, SHORTSTR_MAX, OutboxOptions

Kind = Literal[
    "null",
    "empty",
    "too_long",
    "too_big",
    "non_finite",
    "out_of_range",
    "header_name",
    "not_utf8",
    "control",
    "reserved",
]
#: Largest ``expiration`` RabbitMQ takes (milliseconds, below 2**32).
EXPIRATION_MAX = 2**32 - 1
#: Stands for "the whole row" in checks of the JSON body (no ``body_column``).
ROW = "*"
#: A stream name as ``app.streams.names.check_stream_name`` takes it, per row in Arrow: at most
#: 255 bytes, no control character (this RE2 class), not starting with the reserved prefix
#: (tests/unit/test_spark_stream_options.py holds the two equal)
STREAM_NAME_MAX = 255
STREAM_CONTROL = r"[\x00-\x1f\x7f]"
STREAM_RESERVED = "amq."


class Check(NamedTuple):
    """One rule on one column: ``summary`` groups rows, ``detail(value)`` describes one row."""

    kind: Kind
    column: str
    role: str
    limit: int = 0

    @property
    def summary(self) -> str:
        where = "row JSON" if self.column == ROW else f"column {self.column!r}"
        if self.kind == "null":
            return f"{where} ({self.role}) is null"
        if self.kind == "empty":
            return f"{where} ({self.role}) is empty"
        if self.kind == "too_long":
            return f"{where} ({self.role}) is longer than {self.limit} bytes"
        if self.kind == "too_big":
            return f"{where} ({self.role}) is over the {self.limit}-byte maximum"
        if self.kind == "out_of_range":
            return f"{where} ({self.role}) is outside 0..{self.limit}"
        if self.kind == "header_name":
            return (
                f"{where} ({self.role}) has a header name over {HEADER_NAME_MAX} bytes or "
                "one the publisher sets itself (x-outbox-id, x-outbox-attempt)"
            )
        if self.kind == "not_utf8":
            return f"{where} ({self.role}) has a header value that is not UTF-8"
        if self.kind == "control":
            return f"{where} ({self.role}) holds a control character"
        if self.kind == "reserved":
            return f"{where} ({self.role}) starts with {STREAM_RESERVED!r}, a reserved prefix"
        if self.column == ROW:
            return "row JSON (body) holds NaN or infinity, which JSON cannot carry"
        return f"header column {self.column!r} is NaN or infinite"

    def detail(self, size: int | None = None, value: object = None) -> str:
        """This row's reason, for ``outbox_rejects``; ``size`` is the value's length in bytes."""
        if self.kind in ("null", "empty"):
            return f"{self.column} is {self.kind}"
        if self.kind == "out_of_range":
            return f"{self.column} is {value}, outside 0..{self.limit}"
        if self.kind in ("header_name", "not_utf8"):
            return self.summary
        if self.kind == "control":
            return f"{self.column} {value!r:.80} holds a control character"
        if self.kind == "reserved":
            reserved = f"names starting {STREAM_RESERVED!r} are reserved"
            return f"{self.column} is {value!r:.80}: {reserved}"
        if self.kind == "too_long":
            return f"{self.column} is {size} bytes, over the {self.limit}-byte limit"
        if self.kind == "too_big":
            return f"body is {size} bytes, over the {self.limit}-byte maximum"
        return self.summary


def checks(schema: StructType, options: OutboxOptions) -> list[Check]:
    """Every check a row of ``schema`` must pass, in the order they are tried."""
    types = {f.name: f.dataType for f in schema.fields}
    out: list[Check] = []
    if (key := options.message_id_column) is not None:
        out.append(Check("null", key, "message id"))
        if isinstance(types[key], StringType):
            out += [
                Check("empty", key, "message id"),
                Check("too_long", key, "message id", SHORTSTR_MAX),
            ]
    out += _destination_checks(options)
    if (body := options.body_column) is not None:
        out += [Check("null", body, "body"), Check("too_big", body, "body", options.max_body_bytes)]
    out += [
        Check("non_finite", name, "header")
        for name in options.header_columns
        if isinstance(types[name], FloatType | DoubleType)
    ]
    # the publisher refuses headers over DEFAULT_MAX_HEADER_BYTES in all (app.outbox.content):
    # each string header gets its share, so no row the writer accepts can fail at publish
    strings = [n for n in options.header_columns if isinstance(types[n], StringType)]
    if strings:
        share = header_value_limit(len(strings))
        out += [Check("too_long", name, "header", share) for name in strings]
    if (column := options.content_type_column) is not None:
        out.append(Check("too_long", column, "content type", SHORTSTR_MAX))
    for prop, column in options.property_columns.items():
        role = PROPERTY_ROLES[prop]
        if prop == "priority":
            out.append(Check("out_of_range", column, role, 255))
        elif prop == "expiration":
            out.append(Check("out_of_range", column, role, EXPIRATION_MAX))
        elif prop == "timestamp":
            if not isinstance(types[column], TimestampType | TimestampNTZType):
                out.append(Check("out_of_range", column, role, 2**63 - 1))
        else:
            out.append(Check("too_long", column, role, SHORTSTR_MAX))
    if (column := options.headers_column) is not None:
        out.append(Check("header_name", column, "headers"))
        if kafka_headers(types[column]) and isinstance(kafka_value(types[column]), BinaryType):
            out.append(Check("not_utf8", column, "headers"))
        # bytes of names and values (the JSON's escapes may double them: half the share)
        out.append(Check("too_long", column, "headers", header_value_limit(len(strings) + 1) // 2))
    if body is None:
        if any(holds_floats(t) for t in types.values()):
            out.append(Check("non_finite", ROW, "body"))
        out.append(Check("too_big", ROW, "body", options.max_body_bytes))
    return out


def _destination_checks(options: OutboxOptions) -> list[Check]:
    """The exchange and routing key columns' checks, or the stream column's."""
    out: list[Check] = []
    for role, column in (
        ("exchange", options.exchange_column),
        ("routing key", options.routing_key_column),
    ):
        if column is not None:
            out += [Check("null", column, role), Check("too_long", column, role, SHORTSTR_MAX)]
    if (column := options.stream_column) is not None:
        out += [
            Check("null", column, "stream"),
            Check("empty", column, "stream"),
            Check("too_long", column, "stream", STREAM_NAME_MAX),
            Check("control", column, "stream"),
            Check("reserved", column, "stream"),
        ]
    return out


#: room kept for header names, JSON quoting and escapes within the publisher's header limit
HEADER_OVERHEAD = 4096


def kafka_headers(data_type: DataType) -> bool:
    """Kafka's header column type: ``array<struct<key, value>>``."""
    return (
        isinstance(data_type, ArrayType)
        and isinstance(data_type.elementType, StructType)
        and [f.name for f in data_type.elementType.fields] == ["key", "value"]
    )


def kafka_value(data_type: DataType) -> DataType:
    assert isinstance(data_type, ArrayType) and isinstance(data_type.elementType, StructType)
    return data_type.elementType["value"].dataType


def header_value_limit(string_headers: int) -> int:
    """Most bytes of one string header value when ``string_headers`` of them share the limit."""
    return (DEFAULT_MAX_HEADER_BYTES - HEADER_OVERHEAD) // max(1, string_headers)


def holds_floats(data_type: DataType) -> bool:
    """True when a value of this type is or contains a float or double."""
    if isinstance(data_type, FloatType | DoubleType):
        return True
    if isinstance(data_type, ArrayType):
        return holds_floats(data_type.elementType)
    if isinstance(data_type, MapType):
        return holds_floats(data_type.valueType)
    if isinstance(data_type, StructType):
        return any(holds_floats(f.dataType) for f in data_type.fields)
    return False
