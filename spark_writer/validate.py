"""Checks run on the driver before any write.

``check_schema``: a ``StructType`` in, ``OutboxSchemaError`` out. ``annotate``: a pure DataFrame →
DataFrame function adding ``_outbox_problem``, the first failing ``rules.Check`` of each row as
a Spark expression. ``problem_counts`` runs the one aggregation that turns it into a report.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
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

from app.outbox.content import HEADER_NAME_MAX, RESERVED_HEADERS
from spark_writer.errors import OutboxSchemaError, ProblemCount
from spark_writer.options import OutboxOptions
from spark_writer.rules import ROW, Check, checks, holds_floats, kafka_headers, kafka_value

#: The column ``annotate`` adds: null for a fit row, else its problem's summary.
PROBLEM = "_outbox_problem"
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


def annotate(df: DataFrame, options: OutboxOptions) -> DataFrame:
    """``df`` plus ``_outbox_problem``: the summary of each row's first failing check, or null.

    The size of a JSON body (no ``body_column``) is not known before the writer serialises the
    row, so that one check is left to the executors.
    """
    problem: Column = F.lit(None).cast(StringType())
    for check in reversed(checks(df.schema, options)):
        condition = _condition(check, df)
        if condition is not None:
            problem = F.when(condition, F.lit(check.summary)).otherwise(problem)
    return df.withColumn(PROBLEM, problem)


def problem_counts(df: DataFrame, options: OutboxOptions) -> list[ProblemCount]:
    """Rows per problem, each with an example row: one Spark job over ``df``, a global
    aggregation (no shuffle) with a count and a first example per check."""
    annotated = annotate(df, options)
    example = _example(df, options)
    summaries = list(dict.fromkeys(c.summary for c in checks(df.schema, options)))
    aggregates = []
    for i, summary in enumerate(summaries):
        hit = F.col(PROBLEM) == F.lit(summary)
        aggregates += [
            F.count(F.when(hit, F.lit(1))).alias(f"n{i}"),
            F.first(F.when(hit, example), ignorenulls=True).alias(f"e{i}"),
        ]
    if not aggregates:
        return []
    row = annotated.agg(*aggregates).first()
    assert row is not None
    return [
        ProblemCount(summary, int(row[f"n{i}"]), str(row[f"e{i}"]))
        for i, summary in enumerate(summaries)
        if row[f"n{i}"]
    ]


def _condition(check: Check, df: DataFrame) -> Column | None:
    if check.column == ROW:
        return _non_finite_row(df) if check.kind == "non_finite" else None
    col = df[check.column]
    if check.role == "headers":
        return _headers_condition(check, col, df.schema[check.column].dataType)
    if check.kind == "null":
        return col.isNull()
    if check.kind == "out_of_range":
        return F.coalesce((col < F.lit(0)) | (col > F.lit(check.limit)), F.lit(False))
    if check.kind == "empty":
        return col == F.lit("")
    if check.kind in ("too_long", "too_big"):
        return F.octet_length(col) > F.lit(check.limit)
    return _non_finite(col)


def _headers_condition(check: Check, col: Column, data_type: DataType) -> Column:
    """The checks of a headers column, over its entries (a map's, or Kafka's key/value pairs)."""
    entries = F.map_entries(col) if isinstance(data_type, MapType) else col
    if check.kind == "header_name":
        bad = F.exists(entries, lambda e: (F.octet_length(e["key"]) > F.lit(HEADER_NAME_MAX))
                       | e["key"].isin(*sorted(RESERVED_HEADERS)))  # fmt: skip
    elif check.kind == "not_utf8":
        bad = F.exists(entries, lambda e: ~_valid_utf8(e["value"]))
    else:  # too_long: bytes of names and values, the same sum as the executors'
        size = F.aggregate(
            entries, F.lit(0).cast("long"),
            lambda acc, e: acc + F.coalesce(F.octet_length(e["key"]), F.lit(0))
            + F.coalesce(F.octet_length(e["value"].cast(StringType())), F.lit(0)),
        )  # fmt: skip
        bad = size > F.lit(check.limit)
    return F.coalesce(bad, F.lit(False))


def _valid_utf8(value: Column) -> Column:
    """True when the bytes are UTF-8 (null: valid). Spark 4 has ``is_valid_utf8`` (its
    ``decode`` raises on bad input); Spark 3.5's ``decode`` replaces bad bytes instead."""
    if hasattr(F, "is_valid_utf8"):
        return F.coalesce(F.is_valid_utf8(value), F.lit(True))
    return F.coalesce(F.encode(F.decode(value, "UTF-8"), "UTF-8") == value, F.lit(True))


def _non_finite(col: Column) -> Column:
    return F.isnan(col) | col.isin(float("inf"), float("-inf"))


def _non_finite_row(df: DataFrame) -> Column:
    found = [_non_finite_in(df[f.name], f.dataType) for f in df.schema.fields]
    return _any([c for c in found if c is not None])


def _non_finite_in(col: Column, data_type: DataType) -> Column | None:
    """True when a float anywhere inside ``col`` is NaN or infinite; None when none can be."""
    if not holds_floats(data_type):
        return None
    if isinstance(data_type, FloatType | DoubleType):
        return F.coalesce(_non_finite(col), F.lit(False))
    if isinstance(data_type, ArrayType | MapType):
        element, values = (
            (data_type.elementType, col)
            if isinstance(data_type, ArrayType)
            else (data_type.valueType, F.map_values(col))
        )
        found = F.exists(values, lambda x: _must(_non_finite_in(x, element)))
        return F.coalesce(found, F.lit(False))
    assert isinstance(data_type, StructType)
    fields = [_non_finite_in(col[f.name], f.dataType) for f in data_type.fields]
    return _any([c for c in fields if c is not None])


def _must(condition: Column | None) -> Column:
    assert condition is not None
    return condition


def _any(conditions: list[Column]) -> Column:
    out = conditions[0]
    for condition in conditions[1:]:
        out = out | condition
    return F.coalesce(out, F.lit(False))


def _example(df: DataFrame, options: OutboxOptions) -> Column:
    """What identifies a row in an error: its key, else the start of its JSON."""
    if options.message_id_column is not None:
        name = options.message_id_column
        return F.concat(F.lit(f"{name}="), F.coalesce(df[name].cast(StringType()), F.lit("null")))
    row = F.to_json(F.struct(*[df[c] for c in df.columns]))
    return F.substring(row, 1, EXAMPLE_CHARS)
