"""Schema checks, run on the driver before any task: pure, a ``StructType`` in, errors out."""

from __future__ import annotations

from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

from spark_writer.errors import OutboxSchemaError
from spark_writer.options import OutboxOptions

_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
#: Which Spark types each role accepts, and how to say it in an error.
ACCEPTED: dict[str, tuple[tuple[type[DataType], ...], str]] = {
    "exchange": ((StringType,), "string"),
    "routing key": ((StringType,), "string"),
    "ordering key": ((StringType,), "string"),
    "body": ((BinaryType, StringType), "binary or string"),
    "message id": ((StringType, *_INTEGRAL), "string or integer"),
    "header": (
        (StringType, BooleanType, FloatType, DoubleType, *_INTEGRAL),
        "string, integer, boolean, float or double",
    ),
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
        if not isinstance(fields[column], types):
            got = fields[column].simpleString()
            problems.append(f"column {column!r} ({role}) has type {got}; expected {wanted}")
    return problems


def _missing(column: str, role: str, names: list[str]) -> str:
    near = [n for n in names if n.lower() == column.lower()]
    hint = f" (did you mean {near[0]!r}?)" if near else f"; columns are {names}"
    return f"column {column!r} ({role}) not found{hint}"
