"""Arrow batch → outbox columns, and the per-row checks. Pure: no Spark job, no database.

Every writer (``OutboxSink``, ``write_outbox``, ``format("outbox")``) hands each task's Arrow
record batches to one ``ArrowMapper``, so all produce the same outbox rows by construction.
Checks and mapping are column operations (pyarrow compute); Python touches single rows only to
serialise a JSON body or headers, and to describe a rejected row.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
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

from app.outbox.content import HEADER_NAME_MAX, RESERVED_HEADERS
from spark_writer.options import OutboxOptions
from spark_writer.rules import ROW, STREAM_CONTROL, STREAM_RESERVED, Check, checks

_NUMBERS = (ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType)
_PLAIN = (StringType, BooleanType, *_NUMBERS)
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


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The outbox columns a batch writes: ``varying`` come per row (in ``Chunk.columns``
    order), ``constant`` hold one value for the whole batch."""

    varying: tuple[str, ...]
    constant: tuple[tuple[str, str | bool | None], ...]


class Chunk(NamedTuple):
    """The fit rows of one Arrow batch as outbox columns (``Layout.varying`` order)."""

    rows: int
    columns: tuple[pa.Array, ...]
    rejected: tuple[Rejected, ...]


#: Hidden columns the batch writers add before the write job when there is no key column: the
#: SHA-256 of the row's content (hex) and the row's occurrence among identical rows of the
#: batch (``spark_writer.sinks.with_content_ids``). The mapper takes them off again.
DIGEST = "__outbox_digest"
OCCURRENCE = "__outbox_occurrence"
#: Hex digits of the content digest kept in a message id (128 bits).
DIGEST_CHARS = 32


def derive_message_id(*, sink: str, spark_batch_id: int, partition: int, position: int) -> str:
    """The id of a row by where it sits, ``sink:batch:partition:position``: no writer names
    messages this way any more (a replay laid out otherwise would rename them); it remains the
    label of a rejected row that has no id of its own (a null key column). Messages get their
    key column's value or a content id (:func:`content_message_id`).
    """
    return f"{sink}:{spark_batch_id}:{partition}:{position}"


def content_message_id(*, sink: str, spark_batch_id: int, digest: str, occurrence: int) -> str:
    """The id of a row with no key column, from what it holds: ``sink:batch:digest:n``, the
    first 128 bits of the SHA-256 of the row's content and its occurrence among identical rows
    of the batch. A replay of the batch (the same multiset of rows, whatever its partitioning,
    order or parallelism) gives every row the same id again. The mapper builds the same text
    column-wise from :func:`content_id_prefix` (a test holds the two equal)."""
    return f"{content_id_prefix(sink, spark_batch_id)}{digest[:DIGEST_CHARS]}:{occurrence}"


def content_id_prefix(sink: str, spark_batch_id: int) -> str:
    """What every content id of one batch of one sink starts with."""
    return f"{sink}:{spark_batch_id}:"


#: ``available_at`` of a parked row: written, never due until its batch commits
#: (``format("outbox")`` in fail mode releases a batch's rows once every partition succeeded,
#: or removes them).
PARKED = "9999-12-31 00:00:00"


def layout(
    options: OutboxOptions, schema: StructType, batch: BatchRef, *, parked: bool = False
) -> Layout:
    varying = ["message_id"]
    constant: list[tuple[str, str | bool | None]] = [("batch_id", batch.key)]
    if parked:
        constant.append(("available_at", PARKED))
    if options.stream is not None or options.stream_column is not None:
        # a stream's rows name no exchange or routing key (both NOT NULL: empty)
        constant += [("exchange", ""), ("routing_key", "")]
        destination: tuple[tuple[str, str | None], ...] = (("stream", options.stream),)
    else:
        destination = (("exchange", options.exchange), ("routing_key", options.routing_key))
    for name, literal in destination:
        if literal is None:
            varying.append(name)
        else:
            constant.append((name, literal))
    varying.append("body")
    constant.append(("mandatory", options.mandatory))
    if options.content_type_column is None:
        constant.append(("content_type", _content_type(options, schema)))
    else:
        varying.append("content_type")
    varying += ["headers"] if options.header_columns or options.headers_column else []
    varying += ["ordering_key"] if options.ordering_key_column else []
    if options.property_columns:
        varying.append("properties")
    elif not options.persistent:
        constant.append(("properties", TRANSIENT))
    return Layout(varying=tuple(varying), constant=tuple(constant))


#: ``properties`` of a transient message (the publisher's default is persistent).
TRANSIENT = json.dumps({"delivery_mode": 1}, separators=(",", ":"))


def _content_type(options: OutboxOptions, schema: StructType) -> str:
    if options.content_type:
        return options.content_type
    if options.body_column is None:
        return JSON
    return OCTETS if isinstance(schema[options.body_column].dataType, BinaryType) else TEXT


class ArrowMapper:
    """Checks and maps the Arrow batches of one partition of one batch."""

    def __init__(
        self,
        *,
        options: OutboxOptions,
        schema: StructType,
        batch: BatchRef,
        partition: int,
        parked: bool = False,
    ) -> None:
        self.options = options
        self.batch = batch
        self.layout = layout(options, schema, batch, parked=parked)
        self._default_content_type = _content_type(options, schema)
        self.checks = checks(schema, options)
        self.names = schema.fieldNames()
        self._plain = all(isinstance(f.dataType, _PLAIN) for f in schema.fields)
        self._prefix = derive_message_id(
            sink=batch.sink, spark_batch_id=batch.spark_batch_id, partition=partition, position=0
        )[:-1]
        self._content_prefix = content_id_prefix(batch.sink, batch.spark_batch_id)
        self._occurrences: dict[str, int] = {}

    def map(self, rb: pa.RecordBatch, start: int) -> Chunk:
        """Map one batch whose first row has position ``start`` in the partition."""
        ids, rb = self._ids(rb)
        bodies, unserialisable = self._json_bodies(rb)
        first = self._first_failures(rb, bodies, unserialisable)
        if first is None:
            return Chunk(rb.num_rows, self._columns(rb, bodies, ids), ())
        bad = pc.is_valid(first)
        rejected = self._rejected(rb, bodies, first, bad, ids, start)
        good = pc.invert(bad)
        fit_rows = rb.num_rows - len(rejected)
        kept = bodies.filter(good) if bodies is not None else None
        return Chunk(
            fit_rows, self._columns(rb.filter(good), kept, ids.filter(good)), tuple(rejected)
        )

    def _ids(self, rb: pa.RecordBatch) -> tuple[pa.Array, pa.RecordBatch]:
        """Every row's message id (null where a key column is null: such a row is rejected),
        and the batch without the writer's hidden columns."""
        names = rb.schema.names
        if DIGEST in names and OCCURRENCE in names:
            digest = pc.utf8_slice_codeunits(rb.column(DIGEST), 0, DIGEST_CHARS)
            occurrence = rb.column(OCCURRENCE).cast(pa.string())
            ids = pc.binary_join_element_wise(self._content_prefix, digest, ":", occurrence, "")
            kept = [n for n in names if n not in (DIGEST, OCCURRENCE)]
            rb = pa.RecordBatch.from_arrays([rb.column(n) for n in kept], names=kept)
            if self.options.message_id_column is None:
                return ids, rb
        if self.options.message_id_column is not None:
            return rb.column(self.options.message_id_column).cast(pa.string()), rb
        return self._partition_content_ids(rb), rb

    def _partition_content_ids(self, rb: pa.RecordBatch) -> pa.Array:
        """``format("outbox")`` without a key column (a task sees one partition, no shuffle):
        ``sink:batch:d:n`` from the SHA-256 of the row's JSON and its occurrence among the
        identical rows met so far in this partition. Never from a position: a replay laid out
        otherwise gives every distinct row the same id. Identical rows in different partitions
        share an id, so they become one message (the batch writers count them apart)."""
        out = []
        for row in rb.to_pylist(maps_as_pydicts="lossy"):
            digest = hashlib.sha256(_row(row).encode()).hexdigest()[:DIGEST_CHARS]
            occurrence = self._occurrences.get(digest, 0)
            self._occurrences[digest] = occurrence + 1
            out.append(f"{self._content_prefix}{digest}:{occurrence}")
        return pa.array(out, pa.string())

    # --- checks ---------------------------------------------------------------------------

    def _first_failures(
        self, rb: pa.RecordBatch, bodies: pa.Array | None, unserialisable: pa.Array | None
    ) -> pa.Array | None:
        """Per row the index of its first failing check (null when fit); None when all fit."""
        first = pa.nulls(rb.num_rows, pa.int16())
        failed = False
        for index in reversed(range(len(self.checks))):
            mask = self._mask(self.checks[index], rb, bodies, unserialisable)
            if mask is None or not pc.any(mask).as_py():
                continue
            failed = True
            first = pc.if_else(mask, pa.scalar(index, pa.int16()), first)
        return first if failed else None

    def _mask(
        self,
        check: Check,
        rb: pa.RecordBatch,
        bodies: pa.Array | None,
        unserialisable: pa.Array | None,
    ) -> pa.Array | None:
        if check.column == ROW:
            if check.kind == "non_finite":
                return unserialisable
            return pc.fill_null(pc.greater(pc.binary_length(bodies), check.limit), False)
        values = rb.column(check.column)
        if check.role == "headers":
            return _headers_mask(check, values)
        if check.kind == "null":
            return pc.is_null(values)
        if check.kind == "out_of_range":
            outside = pc.or_(pc.less(values, 0), pc.greater(values, check.limit))
            return pc.fill_null(outside, False)
        if check.kind == "empty":
            mask = pc.equal(values, "")
        elif check.kind == "control":
            mask = pc.match_substring_regex(values, STREAM_CONTROL)
        elif check.kind == "reserved":
            mask = pc.starts_with(values, STREAM_RESERVED)
        elif check.kind in ("too_long", "too_big"):
            mask = pc.greater(pc.binary_length(values), check.limit)
        else:
            mask = pc.or_(pc.is_nan(values), pc.is_inf(values))
        return pc.fill_null(mask, False)

    def _rejected(
        self,
        rb: pa.RecordBatch,
        bodies: pa.Array | None,
        first: pa.Array,
        bad: pa.Array,
        ids: pa.Array,
        start: int,
    ) -> list[Rejected]:
        out = []
        rows = rb.filter(bad).to_pylist(maps_as_pydicts="lossy")
        indices = pc.indices_nonzero(bad).to_pylist()
        failed = pc.filter(first, bad).to_pylist()
        for i, row, index in zip(indices, rows, failed, strict=True):
            check = self.checks[index]
            value = row.get(check.column) if check.column != ROW else _item(bodies, i)
            problem = Problem(check.summary, check.detail(_size(value), value))
            found = ids[i].as_py()
            message_id = found if found is not None else f"{self._prefix}{start + i}"
            out.append(Rejected(start + i, message_id, problem, _row(row)))
        return out

    # --- columns --------------------------------------------------------------------------

    def _columns(
        self, rb: pa.RecordBatch, bodies: pa.Array | None, ids: pa.Array
    ) -> tuple[pa.Array, ...]:
        o = self.options
        out = {
            "message_id": ids,
            "body": bodies if bodies is not None else rb.column(o.body_column).cast(pa.binary()),
        }
        for name, column in (
            ("exchange", o.exchange_column),
            ("routing_key", o.routing_key_column),
            ("stream", o.stream_column),
            ("ordering_key", o.ordering_key_column),
        ):
            if column is not None:
                out[name] = rb.column(column)
        if o.header_columns or o.headers_column:
            out["headers"] = self._headers(rb)
        if o.content_type_column is not None:
            out["content_type"] = pc.fill_null(
                rb.column(o.content_type_column), self._default_content_type
            )
        if o.property_columns:
            out["properties"] = self._properties(rb)
        return tuple(out[name] for name in self.layout.varying)

    def _headers(self, rb: pa.RecordBatch) -> pa.Array:
        """Per row: the headers column's entries, then ``header_columns`` (which win)."""
        names = self.options.header_columns
        columns = [rb.column(name).to_pylist() for name in names]
        if self.options.headers_column is not None:
            column = rb.column(self.options.headers_column)
            maps = [_header_entries(v) for v in column.to_pylist()]
        else:
            maps = [{} for _ in range(rb.num_rows)]
        rows = list(zip(*columns, strict=True)) if columns else [()] * rb.num_rows
        docs = []
        for base, values in zip(maps, rows, strict=True):
            present = base | {n: v for n, v in zip(names, values, strict=True) if v is not None}
            docs.append(json.dumps(present, separators=(",", ":"), allow_nan=False))
        return pa.array(docs, pa.string())

    def _properties(self, rb: pa.RecordBatch) -> pa.Array:
        """Per row the AMQP properties as the publisher reads them (``properties`` JSON)."""
        o = self.options
        props = list(o.property_columns)
        columns = [rb.column(o.property_columns[p]).to_pylist() for p in props]
        docs = []
        for values in zip(*columns, strict=True):
            doc: dict[str, Any] = {} if o.persistent else {"delivery_mode": 1}
            for prop, value in zip(props, values, strict=True):
                if value is None:
                    continue
                if prop == "timestamp" and isinstance(value, dt.datetime):
                    value = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
                    value = value.astimezone(dt.UTC).isoformat()
                doc[prop] = value
            docs.append(json.dumps(doc, separators=(",", ":")))
        return pa.array(docs, pa.string())

    def _json_bodies(self, rb: pa.RecordBatch) -> tuple[pa.Array | None, pa.Array | None]:
        """The whole row as JSON per row (no ``body_column``), and which rows hold NaN or
        infinity (their body is null)."""
        if self.options.body_column is not None:
            return None, None
        bodies: list[bytes | None] = []
        bad: list[bool] = []
        for row in rb.to_pylist(maps_as_pydicts="lossy"):
            try:
                bodies.append(_row(row, allow_nan=False, plain=self._plain).encode())
                bad.append(False)
            except ValueError:
                bodies.append(None)
                bad.append(True)
        return pa.array(bodies, pa.binary()), pa.array(bad, pa.bool_())


def _header_entries(value: Any) -> dict[str, Any]:
    """A headers cell as a dict: a map arrives as (key, value) pairs, Kafka's array as
    ``{"key", "value"}`` structs (a binary value decoded as UTF-8; the checks ran first)."""
    if value is None:
        return {}
    out: dict[str, Any] = {}
    for entry in value:
        key, item = (entry["key"], entry["value"]) if isinstance(entry, dict) else entry
        if isinstance(item, bytes):
            item = item.decode("utf-8", errors="replace")
        if item is not None:
            out[key] = item
    return out


def _headers_mask(check: Check, values: pa.Array) -> pa.Array:
    """A headers column's check per row, over its entries (as ``validate`` does in Spark)."""
    out = []
    for cell in values.to_pylist():
        entries = _raw_entries(cell)
        if check.kind == "header_name":
            bad = any(
                len(k.encode()) > HEADER_NAME_MAX or k in RESERVED_HEADERS for k, _ in entries
            )
        elif check.kind == "not_utf8":
            bad = any(isinstance(v, bytes) and not _utf8(v) for _, v in entries)
        else:
            bad = sum(len(k.encode()) + _text_size(v) for k, v in entries) > check.limit
        out.append(bad)
    return pa.array(out, pa.bool_())


def _raw_entries(cell: Any) -> list[tuple[str, Any]]:
    if cell is None:
        return []
    return [(e["key"], e["value"]) if isinstance(e, dict) else (e[0], e[1]) for e in cell]


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _text_size(value: Any) -> int:
    """Bytes of a header value as Spark casts it to a string (booleans: true/false)."""
    if value is None:
        return 0
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, bool):
        return 4 if value else 5
    return len(str(value).encode())


def _item(values: pa.Array | None, i: int) -> Any:
    return None if values is None else values[i].as_py()


def _size(value: Any) -> int | None:
    if isinstance(value, str):
        return len(value.encode())
    return len(value) if isinstance(value, bytes) else None


def _row(row: dict[str, Any], *, allow_nan: bool = True, plain: bool = False) -> str:
    doc = row if plain else {name: jsonable(value) for name, value in row.items()}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan)


def row_json(row: Sequence[Any], names: Sequence[str]) -> str:
    """A row (values in ``names`` order) as one JSON object, values converted by ``jsonable``."""
    return _row(dict(zip(names, row, strict=True)))


def jsonable(value: Any) -> Any:
    """An Arrow value as JSON: bytes base64, timestamps ISO 8601 in UTC, decimals as exact text."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
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
