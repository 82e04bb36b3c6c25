"""Row → message mapping and per-row checks. Pure: no Spark job, no database.

Both the ``foreachBatch`` writer and the ``format("outbox")`` data source hand every task's Spark
``Row`` objects to one ``RowMapper``, so both produce the same outbox rows by construction.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, NamedTuple

from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

from spark_writer.options import SHORTSTR_MAX, OutboxOptions

_NUMBERS = (ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType)
_PLAIN = (StringType, BooleanType, *_NUMBERS)
_item = tuple.__getitem__  # Row.__getitem__ also takes names: slower, and not needed here
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
OCTETS = "application/octet-stream"


@dataclass(frozen=True, kw_only=True)
class BatchRef:
    """One Spark batch of one sink; ``key`` is its ``batch_id`` in the outbox tables."""

    sink: str
    spark_batch_id: int
    query_id: str | None = None

    @property
    def key(self) -> str:
        return f"{self.sink}:{self.spark_batch_id}"


class Envelope(NamedTuple):
    """One outbox row as the writer inserts it (``headers`` already JSON text)."""

    position: int
    message_id: str
    exchange: str
    routing_key: str
    mandatory: bool
    body: bytes
    content_type: str | None
    headers: str | None
    ordering_key: str | None


class Problem(NamedTuple):
    """Why a row cannot be a message: ``summary`` groups rows, ``detail`` describes this one."""

    summary: str
    detail: str


class Rejected(NamedTuple):
    """A row that failed a check, with what ``outbox_rejects`` keeps of it."""

    position: int
    message_id: str
    problem: Problem
    row_json: str


def derive_message_id(*, sink: str, spark_batch_id: int, partition: int, position: int) -> str:
    """The stable id of a row with no key column, ``sink:batch:partition:position``.

    Readable on purpose: an operator sees where the row came from. The same inputs give the same
    id on any run, so a replayed batch hits ``ON CONFLICT (message_id) DO NOTHING``.
    """
    return f"{sink}:{spark_batch_id}:{partition}:{position}"


def row_json(
    row: tuple[Any, ...], names: Sequence[str], *, allow_nan: bool = True, plain: bool = False
) -> str:
    """The row as one JSON object, values converted by ``jsonable`` unless all are ``plain``."""
    if plain:
        doc = dict(zip(names, row, strict=True))
    else:
        doc = {name: jsonable(value) for name, value in zip(names, row, strict=True)}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan)


def plain_schema(schema: StructType) -> bool:
    """True when every column is already a JSON value (string, number, boolean)."""
    return all(isinstance(f.dataType, _PLAIN) for f in schema.fields)


def jsonable(value: Any) -> Any:
    """A Spark value as JSON: bytes base64, timestamps ISO 8601 in UTC, decimals as exact text."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, tuple) and hasattr(value, "__fields__"):  # a nested Row
        return {k: jsonable(v) for k, v in zip(value.__fields__, value, strict=True)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return _scalar(value)


def _scalar(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat()
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)


class RowMapper:
    """Maps the rows of one partition of one batch to ``Envelope`` or ``Rejected``."""

    def __init__(
        self, *, options: OutboxOptions, schema: StructType, batch: BatchRef, partition: int
    ) -> None:
        self.options = options
        self.batch = batch
        self.partition = partition
        self.names = schema.fieldNames()
        index = {name: i for i, name in enumerate(self.names)}
        self._index = index
        self._plain = plain_schema(schema)
        self._headers = [(name, index[name]) for name in options.header_columns]
        self._body = self._body_reader(options, schema, index)
        self._content_type = options.content_type or self._default_content_type(schema)

    def map(self, row: tuple[Any, ...], position: int) -> Envelope | Rejected:
        """Check one row and map it; ``position`` is its index in the partition, from 0."""
        o = self.options
        key = self._value(row, o.message_id_column)
        message_id = self._message_id(key, position)
        exchange = self._literal_or_column(row, o.exchange, o.exchange_column)
        routing_key = self._literal_or_column(row, o.routing_key, o.routing_key_column)
        body, body_problem = self._body(row)
        headers, headers_problem = self._header_json(row)
        problem = (
            self._key_problem(key)
            or _shortstr_problem(exchange, o.exchange_column, "exchange")
            or _shortstr_problem(routing_key, o.routing_key_column, "routing key")
            or body_problem
            or self._size_problem(body)
            or headers_problem
        )
        if problem is not None:
            return Rejected(position, message_id, problem, row_json(row, self.names))
        assert exchange is not None and routing_key is not None and body is not None
        ordering_key = self._value(row, o.ordering_key_column)
        return Envelope(
            position,
            message_id,
            exchange,
            routing_key,
            o.mandatory,
            body,
            self._content_type,
            headers,
            ordering_key,
        )

    def _value(self, row: tuple[Any, ...], column: str | None) -> Any:
        return None if column is None else _item(row, self._index[column])

    def _literal_or_column(
        self, row: tuple[Any, ...], literal: str | None, column: str | None
    ) -> Any:
        return literal if literal is not None else self._value(row, column)

    def _message_id(self, key: Any, position: int) -> str:
        if key is not None:
            return str(key)
        return derive_message_id(
            sink=self.batch.sink,
            spark_batch_id=self.batch.spark_batch_id,
            partition=self.partition,
            position=position,
        )

    def _key_problem(self, key: Any) -> Problem | None:
        column = self.options.message_id_column
        if column is None:
            return None
        if key is None or key == "":
            what = "null" if key is None else "empty"
            return Problem(f"column {column!r} (message id) is {what}", f"{column} is {what}")
        return _shortstr_problem(str(key), column, "message id")

    def _size_problem(self, body: bytes | None) -> Problem | None:
        limit = self.options.max_body_bytes
        if body is None or len(body) <= limit:
            return None
        where = f"column {self.options.body_column!r}" if self.options.body_column else "row JSON"
        return Problem(
            f"{where} (body) is over the {limit}-byte maximum",
            f"body is {len(body)} bytes, over the {limit}-byte maximum",
        )

    def _header_json(self, row: tuple[Any, ...]) -> tuple[str | None, Problem | None]:
        if not self._headers:
            return None, None
        values = {name: v for name, i in self._headers if (v := _item(row, i)) is not None}
        try:
            return json.dumps(values, separators=(",", ":"), allow_nan=False), None
        except ValueError:
            bad = [n for n, v in values.items() if isinstance(v, float) and not math.isfinite(v)]
            what = f"header column {bad[0]!r} is NaN or infinite"
            return None, Problem(what, what)

    def _default_content_type(self, schema: StructType) -> str:
        if self.options.body_column is None:
            return JSON
        return OCTETS if isinstance(schema[self.options.body_column].dataType, BinaryType) else TEXT

    def _body_reader(
        self, options: OutboxOptions, schema: StructType, index: dict[str, int]
    ) -> Callable[[tuple[Any, ...]], tuple[bytes | None, Problem | None]]:
        column = options.body_column
        if column is None:
            return self._json_body
        i = index[column]
        null = Problem(f"column {column!r} (body) is null", f"{column} is null")

        def read(row: tuple[Any, ...]) -> tuple[bytes | None, Problem | None]:
            value = _item(row, i)
            if value is None:
                return None, null
            return (value.encode() if isinstance(value, str) else bytes(value)), None

        return read

    def _json_body(self, row: tuple[Any, ...]) -> tuple[bytes | None, Problem | None]:
        try:
            return row_json(row, self.names, allow_nan=False, plain=self._plain).encode(), None
        except ValueError:
            what = "row JSON (body) holds NaN or infinity, which JSON cannot carry"
            return None, Problem(what, what)


def _shortstr_problem(value: Any, column: str | None, role: str) -> Problem | None:
    """Null or over 255 bytes: an AMQP short string cannot carry it."""
    if column is None:  # a literal, checked with the options
        return None
    if value is None:
        return Problem(f"column {column!r} ({role}) is null", f"{column} is null")
    size = len(str(value).encode())
    if size > SHORTSTR_MAX:
        return Problem(
            f"column {column!r} ({role}) is longer than {SHORTSTR_MAX} bytes",
            f"{column} is {size} bytes, over the {SHORTSTR_MAX}-byte limit",
        )
    return None
