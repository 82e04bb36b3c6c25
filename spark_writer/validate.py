"""The check run on the driver before any write: ``check_schema``, a ``StructType`` in,
``OutboxSchemaError`` out. The rows are checked in the tasks that write them
(``envelope.ArrowMapper``, evaluating ``rules.checks``): the input is read once.
"""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from spark_writer.errors import OutboxSchemaError
from spark_writer.options import OutboxOptions
from spark_writer.rules import kafka_headers, kafka_value

HEADERS_TYPES = (
    "map<string, string|integer|boolean> or array<struct<key: string, value: string|binary>>"
)
#: How much of a row an example in an error shows.
EXAMPLE_CHARS = 200

_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
#: Which Spark types each role accepts, and how to say it in an error.
ACCEPTED: dict[str, tuple[tuple[type[DataType], ...], str]] = {
    "exchange": ((StringType,), "string"),
    "routing key": ((StringType,), "string"),
    "stream": ((StringType,), "string"),
    "ordering key": ((StringType,), "string"),
    "sequence": (
        (
            *_INTEGRAL,
            FloatType,
            DoubleType,
            DecimalType,
            TimestampType,
            TimestampNTZType,
            DateType,
            StringType,
        ),
        "integer, float, decimal, timestamp, date or string",
    ),
    "body": ((BinaryType, StringType), "binary or string"),
    "message id": ((StringType, *_INTEGRAL), "string or integer"),
    "header": (
        (StringType, BooleanType, FloatType, DoubleType, *_INTEGRAL),
        "string, integer, boolean, float or double",
    ),
    "content type": ((StringType,), "string"),
    "priority": (_INTEGRAL, "integer"),
    "expiration": (_INTEGRAL, "integer (milliseconds)"),
    "timestamp": (
        (TimestampType, TimestampNTZType, *_INTEGRAL),
        "timestamp or integer (epoch seconds)",
    ),
    "correlation id": ((StringType,), "string"),
    "type": ((StringType,), "string"),
    "app id": ((StringType,), "string"),
    "reply to": ((StringType,), "string"),
    "headers": ((MapType, ArrayType), HEADERS_TYPES),
}


def check_schema(schema: StructType, options: OutboxOptions) -> None:
    """Raise ``OutboxSchemaError`` listing every named column that is missing or mistyped."""
    problems = schema_problems(schema, options)
    if problems:
        raise OutboxSchemaError(problems)


def schema_problems(schema: StructType, options: OutboxOptions) -> list[str]:
    fields = {f.name: f.dataType for f in schema.fields}
    problems: list[str] = []
    for role, column in options.columns:
        if column not in fields:
            problems.append(_missing(column, role, list(fields)))
            continue
        types, wanted = ACCEPTED[role]
        if not isinstance(fields[column], types) or (
            role == "headers" and not headers_type(fields[column])
        ):
            got = fields[column].simpleString()
            problems.append(f"column {column!r} ({role}) has type {got}; expected {wanted}")
    return problems


def headers_type(data_type: DataType) -> bool:
    """A headers column's type: ``map<string, string|integer|boolean>`` or Kafka's
    ``array<struct<key: string, value: string|binary>>``."""
    if isinstance(data_type, MapType):
        return isinstance(data_type.keyType, StringType) and isinstance(
            data_type.valueType, (StringType, BooleanType, *_INTEGRAL)
        )
    if kafka_headers(data_type):
        assert isinstance(data_type, ArrayType) and isinstance(data_type.elementType, StructType)
        key = data_type.elementType["key"].dataType
        return isinstance(key, StringType) and isinstance(
            kafka_value(data_type), StringType | BinaryType
        )
    return False


def _missing(column: str, role: str, names: list[str]) -> str:
    near = [n for n in names if n.lower() == column.lower()]
    hint = f" (did you mean {near[0]!r}?)" if near else f"; columns are {names}"
    return f"column {column!r} ({role}) not found{hint}"
