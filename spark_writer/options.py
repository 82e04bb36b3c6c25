"""What the writer is told: one frozen ``OutboxOptions``, checked when built, sent to executors."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from app.outbox.content import EXCHANGE_NAME, HEADER_NAME_MAX, RESERVED_HEADERS
from app.streams.names import StreamNameError, check_stream_name
from spark_writer.delivery import DEFAULT_WAIT_TIMEOUT, Wait, checked_timeout, checked_wait
from spark_writer.errors import OutboxConfigError

#: RabbitMQ's default largest message (``max_message_size``), 16 MiB.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: seconds a recorded batch waits for the streaming standbys (``standby_wait``)
DEFAULT_STANDBY_WAIT = 30.0
#: AMQP ``shortstr``: exchange names, routing keys and message ids are at most 255 bytes.
SHORTSTR_MAX = 255
_SINK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_URL_PREFIXES = ("postgresql", "postgres://", "sqlite")

OnInvalid = Literal["fail", "reject"]
#: ``property_columns`` keys (AMQP basic properties a row may set) -> the role in messages
PROPERTY_ROLES = {
    "priority": "priority",
    "expiration": "expiration",
    "timestamp": "timestamp",
    "correlation_id": "correlation id",
    "type": "type",
    "app_id": "app id",
    "reply_to": "reply to",
}


@dataclass(frozen=True, kw_only=True)
class OutboxOptions:
    """Where rows go and how each row maps to a message.

    Give exactly one of ``exchange`` (a literal; ``""`` is the default exchange) and
    ``exchange_column``, and exactly one of ``routing_key`` and ``routing_key_column``; or,
    for a RabbitMQ stream instead of an exchange, exactly one of ``stream`` and
    ``stream_column`` (and no exchange, routing key or ordering key). With no
    ``body_column`` the whole row is the body, as JSON with ``content_type=application/json``.
    ``on_invalid="fail"`` refuses a batch holding any bad row; ``"reject"`` writes the good rows
    and puts the bad ones in ``outbox_rejects`` with the reason.
    """

    url: str
    sink: str
    exchange: str | None = None
    exchange_column: str | None = None
    routing_key: str | None = None
    routing_key_column: str | None = None
    #: a RabbitMQ stream every row is appended to (``stream``), or a string column naming
    #: each row's (``stream_column``), instead of an exchange: the rows get ``exchange`` and
    #: ``routing_key`` ``''`` and the publisher's stream relay appends each exactly once
    stream: str | None = None
    stream_column: str | None = None
    body_column: str | None = None
    content_type: str | None = None
    header_columns: tuple[str, ...] = field(default_factory=tuple)
    message_id_column: str | None = None
    ordering_key_column: str | None = None
    #: sorts the rows of each ordering key (event time or a sequence number): the writer lays
    #: a batch out so that outbox ids, hence publishes, follow it within each key
    sequence_column: str | None = None
    mandatory: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    on_invalid: OnInvalid = "fail"
    #: a column of headers per row: ``map<string, string|integer|boolean>``, or Kafka's
    #: ``array<struct<key: string, value: string|binary>>`` (values UTF-8); ``header_columns``
    #: win over a header of the same name
    headers_column: str | None = None
    #: the content type per row (a string column; null: ``content_type`` or the default)
    content_type_column: str | None = None
    #: AMQP property -> column, per row: ``priority`` (0-255), ``expiration`` (milliseconds),
    #: ``timestamp`` (a timestamp, or epoch seconds), ``correlation_id``, ``type``, ``app_id``,
    #: ``reply_to`` (strings); a null value sets no property
    property_columns: Mapping[str, str] = field(default_factory=dict)
    #: delivery mode 2 (the broker writes the message to disk) or 1 (transient)
    persistent: bool = True
    #: at most this many partitions write at once, each on one database connection (like
    #: JDBC's ``numPartitions``): a DataFrame with more partitions is coalesced before the write
    max_connections: int | None = None
    #: a file on every executor (a mounted secret) holding the PostgreSQL password, read where
    #: the connection is made: keep the password out of ``url``, so it is never in Spark's
    #: conf, plan, UI or event log (libpq's ``PGPASSFILE`` works too)
    password_file: str | None = None
    #: when a write returns: ``"written"`` (its rows are in the outbox) or ``"confirmed"``
    #: (every row settled at the broker: the writer waits, returns the ``Delivery`` and raises
    #: ``OutboxDeliveryError`` when a row ended returned, nacked or failed, or at the timeout)
    wait: Wait = "written"
    #: seconds ``wait="confirmed"`` waits for the batch's rows to settle
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT
    #: PostgreSQL with streaming standbys: seconds the driver waits, once the batch is
    #: recorded, for every standby to have it on disk; past it the batch fails and Spark runs
    #: it again (``OutboxReplicationError``). 0: do not wait (a failover to an asynchronous
    #: standby may then undo a batch that Spark's checkpoint says is done)
    standby_wait: float = DEFAULT_STANDBY_WAIT

    def __post_init__(self) -> None:
        object.__setattr__(self, "header_columns", tuple(self.header_columns))
        object.__setattr__(self, "property_columns", dict(self.property_columns))
        problems = _problems(self)
        if problems:
            raise OutboxConfigError("invalid outbox options: " + "; ".join(problems))

    @property
    def columns(self) -> list[tuple[str, str]]:
        """Every (role, column) the options name; one column may serve several roles."""
        named = [
            ("exchange", self.exchange_column),
            ("routing key", self.routing_key_column),
            ("stream", self.stream_column),
            ("body", self.body_column),
            ("message id", self.message_id_column),
            ("ordering key", self.ordering_key_column),
            ("sequence", self.sequence_column),
        ]
        named += [("header", col) for col in self.header_columns]
        named += [("headers", self.headers_column), ("content type", self.content_type_column)]
        named += [
            (PROPERTY_ROLES[p], col)
            for p, col in self.property_columns.items()
            if p in PROPERTY_ROLES
        ]
        return [(role, col) for role, col in named if col is not None]


def _problems(o: OutboxOptions) -> list[str]:
    out: list[str] = []
    if not o.url.startswith(_URL_PREFIXES) or o.url.rstrip("/") in ("sqlite:", "sqlite:/"):
        out.append("url must be a postgresql://, postgresql+psycopg:// or sqlite:///PATH URL")
    if not _SINK_NAME.fullmatch(o.sink):
        out.append(f"sink {o.sink!r} must be 1-100 letters, digits, '.', '_' or '-'")
    out += _destination(o)
    for name, literal in (("exchange", o.exchange), ("routing_key", o.routing_key)):
        if literal is not None and len(literal.encode()) > SHORTSTR_MAX:
            out.append(f"{name} is longer than {SHORTSTR_MAX} bytes")
    if o.exchange is not None and not EXCHANGE_NAME.match(o.exchange):
        out.append(
            f"exchange {o.exchange[:80]!r} holds characters no publish can carry: letters, "
            "digits, space and - _ . : @ # , / + only"
        )
    for name in o.header_columns:  # header names as the publisher accepts them
        if len(name.encode()) > HEADER_NAME_MAX:
            out.append(
                f"header column {name!r} is longer than {HEADER_NAME_MAX} bytes: "
                "rename it (its name is the header's name)"
            )
        if name in RESERVED_HEADERS:
            out.append(f"header column {name!r} is a header the publisher sets itself")
    if o.sequence_column is not None and o.ordering_key_column is None:
        out.append(
            "sequence_column orders the rows of each ordering key: give ordering_key_column too"
        )
    if o.password_file is not None:
        if o.url.startswith("sqlite"):
            out.append("password_file is for PostgreSQL; SQLite has no password")
        elif _url_password(o.url):
            out.append(
                "url holds a password and password_file is given: take the password "
                "out of the url (Spark would show it)"
            )
    if o.max_connections is not None and o.max_connections < 1:
        out.append("max_connections must be at least 1")
    unknown = sorted(set(o.property_columns) - set(PROPERTY_ROLES))
    if unknown:
        out.append(
            f"property_columns: unknown properties {unknown}; known are "
            f"{sorted(PROPERTY_ROLES)} (content type: content_type_column; delivery "
            "mode: persistent)"
        )
    if o.content_type_column is not None and o.content_type is not None:
        out.append(
            "give content_type (one for the batch) or content_type_column, not both; "
            "a null in the column takes the default for the body"
        )
    if o.max_body_bytes < 1:
        out.append("max_body_bytes must be at least 1")
    if o.on_invalid not in ("fail", "reject"):
        out.append(f"on_invalid must be 'fail' or 'reject', not {o.on_invalid!r}")
    if not (o.standby_wait >= 0 and o.standby_wait != float("inf")):
        out.append(f"standby_wait must be seconds, 0 or more, not {o.standby_wait!r}")
    for check, value in ((checked_wait, o.wait), (checked_timeout, o.wait_timeout)):
        try:
            check(value)
        except ValueError as error:
            out.append(str(error))
    return out


def _url_password(url: str) -> bool:
    """True when ``scheme://user:password@host`` carries a password."""
    rest = url.split("://", 1)[-1]
    userinfo = rest.split("@", 1)[0] if "@" in rest.split("/", 1)[0] else ""
    return ":" in userinfo


def _destination(o: OutboxOptions) -> list[str]:
    """Exactly one kind of destination: an exchange and a routing key, or a stream."""
    exchange = [
        n
        for n, v in (
            ("exchange", o.exchange),
            ("exchange_column", o.exchange_column),
            ("routing_key", o.routing_key),
            ("routing_key_column", o.routing_key_column),
        )
        if v is not None
    ]
    stream = [
        n for n, v in (("stream", o.stream), ("stream_column", o.stream_column)) if v is not None
    ]
    if stream and exchange:
        return [
            f"a row goes to an exchange or to a stream, not both: give {' and '.join(stream)} "
            f"without {', '.join(exchange)}, or the exchange options without a stream"
        ]
    if not stream and not exchange:
        return [
            "give a destination: exchange or exchange_column with routing_key or "
            "routing_key_column, or stream or stream_column"
        ]
    if exchange:
        return _one_of("exchange", o.exchange, o.exchange_column) + _one_of(
            "routing_key", o.routing_key, o.routing_key_column
        )
    out = _one_of("stream", o.stream, o.stream_column)
    if o.stream is not None:
        try:
            check_stream_name(o.stream)
        except StreamNameError as exc:
            out.append(f"option stream: {exc}")
    if o.ordering_key_column is not None:
        out.append(
            "ordering_key_column is for exchanges: a stream keeps its messages in order by "
            "itself (one lane: id order)"
        )
    return out


def _one_of(name: str, literal: str | None, column: str | None) -> list[str]:
    if (literal is None) == (column is None):
        return [f"give exactly one of {name} and {name}_column"]
    return []


def options_of(options: OutboxOptions | None, keywords: Mapping[str, Any]) -> OutboxOptions:
    """The writers' one way in: an ``OutboxOptions``, or its fields as keywords (not both)."""
    if options is not None:
        if keywords:
            raise OutboxConfigError(
                f"give OutboxOptions or keyword options, not both: {sorted(keywords)}"
            )
        if not isinstance(options, OutboxOptions):
            kind = type(options).__name__
            raise OutboxConfigError(f"options must be an OutboxOptions, not {kind}")
        return options
    known = {f.name for f in fields(OutboxOptions)}
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise OutboxConfigError(f"unknown outbox options {unknown}; known are {sorted(known)}")
    for required in ("url", "sink"):
        if required not in keywords:
            raise OutboxConfigError(f"option {required!r} is required")
    return OutboxOptions(**keywords)


# --- Spark data source options (strings, case-insensitive) ------------------------------------

#: Data source option (lower case, no underscores: ``routingKey``, ``routing_key``) -> field.
#: ``max_connections`` is not one: ``format("outbox")`` writes one connection per partition.
_SPARK_KEYS = {
    f.name.replace("_", ""): f.name for f in fields(OutboxOptions) if f.name != "max_connections"
}
#: Options Spark itself passes along with the user's; the writer does not use them.
_SPARK_OWN = {"checkpointlocation", "path", "queryname"}


def from_spark_options(raw: Mapping[str, str]) -> tuple[OutboxOptions, int | None]:
    """Parse data source options (``routingKey`` or ``routing_key``, any case) and ``batchId``."""
    values: dict[str, object] = {}
    batch_id: int | None = None
    for key, value in raw.items():
        norm = key.lower().replace("_", "")
        if norm == "batchid":
            batch_id = _to_int(key, value)
        elif norm in _SPARK_KEYS:
            values[_SPARK_KEYS[norm]] = _convert(_SPARK_KEYS[norm], key, value)
        elif norm == "maxconnections":
            raise OutboxConfigError(
                f"option {key!r}: format('outbox') opens one connection per partition it "
                "writes; cap them with df.coalesce(N) before .write (OutboxSink and "
                "write_outbox take max_connections)"
            )
        elif norm not in _SPARK_OWN:
            raise OutboxConfigError(f"unknown outbox option {key!r}")
    for required in ("url", "sink"):
        if required not in values:
            raise OutboxConfigError(f"option {required!r} is required")
    return OutboxOptions(**values), batch_id  # type: ignore[arg-type]


def _convert(name: str, key: str, value: str) -> object:
    if name == "header_columns":
        return tuple(c.strip() for c in value.split(",") if c.strip())
    if name == "property_columns":  # "priority=prio, correlation_id=corr"
        pairs = [p.strip() for p in value.split(",") if p.strip()]
        if not all("=" in p for p in pairs):
            raise OutboxConfigError(f"option {key!r} is property=column, ...: not {value!r}")
        return {p.split("=", 1)[0].strip(): p.split("=", 1)[1].strip() for p in pairs}
    if name in ("mandatory", "persistent"):
        if value.strip().lower() not in ("true", "false"):
            raise OutboxConfigError(f"option {key!r} must be true or false, not {value!r}")
        return value.strip().lower() == "true"
    if name == "max_body_bytes":
        return _to_int(key, value)
    if name in ("wait_timeout", "standby_wait"):
        try:
            return float(value)
        except ValueError:
            raise OutboxConfigError(f"option {key!r} must be seconds, not {value!r}") from None
    if name == "wait":
        return value.strip().lower()
    return value


def _to_int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise OutboxConfigError(f"option {key!r} must be an integer, not {value!r}") from None
