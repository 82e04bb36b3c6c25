"""What an outbox row may contain: one validation layer for every writer and for the publisher.

Rows are untrusted input: a Spark job writes them, and so can anyone with INSERT on the table. The
publisher reads each row through :func:`check_row` before it builds a message, and the Spark writer
enforces the same limits before it writes (``spark_writer`` imports this module). Pure: standard
library only, no SQLAlchemy, no pamqp, so executors can import it.

A row that breaks a rule raises :class:`ContentError` with a reason an operator can act on; the
publisher then ends that row ``failed`` with the reason, alone. Nothing here can raise anything
else for any input (the fuzz test in ``tests/unit/test_content.py`` holds it to that).

Limits (AMQP 0-9-1 and RabbitMQ):

- exchange, routing key, ``message_id``, content type and the string properties are ``shortstr``:
  at most 255 bytes of UTF-8;
- header names are at most 128 bytes (the spec's field-name limit; longer ones used to be cut
  silently by the encoder);
- headers nest at most :data:`MAX_HEADER_DEPTH` levels and their JSON text is at most
  ``max_header_bytes``; the content header frame must also fit the broker's negotiated
  ``frame_max``, which only the publisher knows (checked when it encodes);
- ``properties`` keys are the AMQP basic properties below and nothing else (a misspelt key is a
  mistake to report, not to ignore).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

SHORTSTR_MAX = 255
HEADER_NAME_MAX = 128
MAX_HEADER_DEPTH = 8
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
#: JSON text of ``properties`` larger than this cannot be valid (a few short strings and ints).
MAX_PROPERTIES_BYTES = 8 * 1024
INT64 = (-(2**63), 2**63 - 1)
#: Headers the publisher sets on every publish; a row may not set them itself.
PUBLISHER_HEADERS = frozenset({"x-outbox-id", "x-outbox-attempt"})
#: Set by the broker, read by consumers as the broker's word: a quorum queue's redelivery count.
#: A producer's own ``x-delivery-count: 999`` dead-lettered a message on its first delivery
#: without its handler running (issue 48).
BROKER_HEADERS = frozenset({"x-delivery-count"})
RESERVED_HEADERS = PUBLISHER_HEADERS | BROKER_HEADERS
DELIVERY_MODES = (1, 2)
PERSISTENT = 2

#: ``properties`` key -> AMQP ``Basic.Properties`` attribute (pamqp's names).
PROPERTY_NAMES: Mapping[str, str] = {
    "priority": "priority",
    "expiration": "expiration",
    "correlation_id": "correlation_id",
    "type": "message_type",
    "message_type": "message_type",
    "app_id": "app_id",
    "reply_to": "reply_to",
    "content_encoding": "content_encoding",
    "delivery_mode": "delivery_mode",
    "timestamp": "timestamp",
}
SHORTSTR_PROPERTIES = frozenset(
    {"correlation_id", "message_type", "app_id", "reply_to", "content_encoding"}
)
_PROPERTY_WHAT = {name: f"property {name}" for name in SHORTSTR_PROPERTIES}


class ContentError(ValueError):
    """A row holds something that cannot become a valid AMQP message (permanent for that row)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The configurable limits (the rest are the protocol's)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES


# ---------------------------------------------------------------------------- strings


def check_shortstr(value: object, *, what: str, empty_ok: bool = False) -> str:
    """A ``shortstr`` field: a string of at most 255 bytes of valid UTF-8, no NUL."""
    if (  # the common case in C calls only: ASCII, so its length is its size in bytes
        type(value) is str
        and len(value) <= SHORTSTR_MAX
        and value.isascii()
        and (value or empty_ok)
        and "\x00" not in value
    ):
        return value
    if not isinstance(value, str):
        raise ContentError(f"{what} must be a string, got {_type(value)}")
    size = _utf8_size(value, what=what)
    if size > SHORTSTR_MAX:
        raise ContentError(f"{what} is {size} bytes, over the AMQP limit of {SHORTSTR_MAX}")
    if not value and not empty_ok:
        raise ContentError(f"{what} is empty")
    if "\x00" in value:
        raise ContentError(f"{what} contains a NUL character")
    return value


def _utf8_size(value: str, *, what: str) -> int:
    if value.isascii():
        return len(value)
    try:
        return len(value.encode())
    except UnicodeEncodeError:
        raise ContentError(f"{what} is not valid UTF-8 (a lone surrogate)") from None


def _type(value: object) -> str:
    return "null" if value is None else type(value).__name__


# ----------------------------------------------------------------------------- JSON


def load_document(raw: object, *, what: str, max_bytes: int) -> Any:
    """A JSON column as stored: ``None``, JSON text (str or bytes), or an already decoded value.

    Bounded before it is parsed: text over ``max_bytes``, nesting deep enough to exhaust the
    parser, NaN/Infinity and invalid UTF-8 are a :class:`ContentError`, never a crash.
    """
    if raw is None or type(raw) is dict or isinstance(raw, dict | list | int | float | bool):
        return raw
    if isinstance(raw, bytes | bytearray | memoryview):
        raw = bytes(raw)
        if len(raw) > max_bytes:
            raise ContentError(
                f"{what} is {len(raw)} bytes of JSON, over the {max_bytes}-byte limit"
            )
        try:
            raw = raw.decode()
        except UnicodeDecodeError:
            raise ContentError(f"{what} is not valid UTF-8") from None
    if not isinstance(raw, str):
        raise ContentError(f"{what} must be JSON text, got {_type(raw)}")
    size = _utf8_size(raw, what=what)
    if size > max_bytes:
        raise ContentError(f"{what} is {size} bytes of JSON, over the {max_bytes}-byte limit")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ContentError(f"{what} is nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, and our NaN/Infinity refusal
        raise ContentError(f"{what} is not valid JSON: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# --------------------------------------------------------------------------- headers


def check_headers(value: object, *, max_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> dict[str, Any]:
    """Headers as stored (JSON text or decoded) -> a dict a field table can carry.

    ``None`` and ``{}`` give ``{}``. Keys: non-empty strings of at most 128 bytes, not one of
    :data:`RESERVED_HEADERS`. Values: null, booleans, 64-bit integers, finite floats, strings,
    and lists or objects of those, nested at most :data:`MAX_HEADER_DEPTH` levels.
    """
    doc = load_document(value, what="headers", max_bytes=max_bytes)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ContentError(f"headers must be a JSON object, got {_json_type(doc)}")
    _check_table(doc, depth=1, path="headers")
    return doc


def _json_type(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return _type(value)


def _check_table(table: dict[Any, Any], *, depth: int, path: str) -> None:
    if depth > MAX_HEADER_DEPTH:
        raise ContentError(f"{path} nests deeper than {MAX_HEADER_DEPTH} levels")
    for key, item in table.items():
        if not (type(key) is str and 0 < len(key) <= HEADER_NAME_MAX and key.isascii()):
            _check_name(key, path=path)
        if depth == 1 and key in RESERVED_HEADERS:
            who = "the broker" if key in BROKER_HEADERS else "the publisher"
            raise ContentError(f"header {key!r} is set by {who}; a row may not set it")
        if item is None or (type(item) is str and item.isascii()):
            continue  # the common values, without building their path
        _check_value(item, depth=depth, path=f"{path}.{key}")


def _check_name(key: object, *, path: str) -> None:
    if not isinstance(key, str) or not key:
        raise ContentError(f"{path} has an empty or non-string name")
    size = _utf8_size(key, what=f"header name in {path}")
    if size > HEADER_NAME_MAX:
        raise ContentError(
            f"header name {key[:40]!r}... in {path} is {size} bytes, over the AMQP limit "
            f"of {HEADER_NAME_MAX}"
        )


def _check_value(item: object, *, depth: int, path: str) -> None:
    if item is None or isinstance(item, bool):
        return
    if isinstance(item, int):
        if not INT64[0] <= item <= INT64[1]:
            raise ContentError(f"{path} is an integer outside 64 bits")
        return
    if isinstance(item, float):
        if not math.isfinite(item):
            raise ContentError(f"{path} is not a finite number")
        return
    if isinstance(item, str):
        if not item.isascii():
            _utf8_size(item, what=path)
        return
    if isinstance(item, dict):
        _check_table(item, depth=depth + 1, path=path)
        return
    if isinstance(item, list):
        if depth + 1 > MAX_HEADER_DEPTH:
            raise ContentError(f"{path} nests deeper than {MAX_HEADER_DEPTH} levels")
        for index, element in enumerate(item):
            _check_value(element, depth=depth + 1, path=f"{path}[{index}]")
        return
    raise ContentError(f"{path} has a value of type {_type(item)}")


# ------------------------------------------------------------------------ properties


def check_properties(value: object) -> dict[str, Any]:
    """``properties`` as stored -> AMQP property values keyed by pamqp's attribute names.

    ``delivery_mode`` defaults to 2 (persistent). ``expiration`` is milliseconds (digits or a
    non-negative integer); ``timestamp`` is seconds since the epoch (an integer) or an ISO 8601
    time with a timezone.
    """
    doc = load_document(value, what="properties", max_bytes=MAX_PROPERTIES_BYTES)
    out: dict[str, Any] = {"delivery_mode": PERSISTENT}
    if doc is None:
        return out
    if not isinstance(doc, dict):
        raise ContentError(f"properties must be a JSON object, got {_json_type(doc)}")
    unknown = [k for k in doc if k not in PROPERTY_NAMES]
    if unknown:
        known = ", ".join(sorted(PROPERTY_NAMES))
        shown = sorted(str(k) for k in unknown)[:5]
        raise ContentError(f"unknown properties {shown}: known are {known}")
    for key, item in doc.items():
        if item is None:
            continue
        name = PROPERTY_NAMES[key]
        out[name] = _property(name, item)
    return out


def _property(name: str, item: object) -> Any:
    if name in SHORTSTR_PROPERTIES:
        return check_shortstr(item, what=_PROPERTY_WHAT[name], empty_ok=True)
    if name == "priority":
        return _small_int(item, name, range(256))
    if name == "delivery_mode":
        return _small_int(item, name, DELIVERY_MODES)
    if name == "expiration":
        return _expiration(item)
    return _timestamp(item)


def _small_int(item: object, name: str, allowed: range | tuple[int, ...]) -> int:
    if isinstance(item, bool) or not isinstance(item, int) or item not in allowed:
        shown = f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else allowed
        raise ContentError(f"property {name} must be one of {shown}, got {item!r}"[:200])
    return item


def _expiration(item: object) -> str:
    """RabbitMQ closes the channel (406) on a non-numeric expiration: refuse it here instead."""
    if isinstance(item, int) and not isinstance(item, bool) and 0 <= item < 2**32:
        return str(item)
    digits = isinstance(item, str) and item.isascii() and item.isdigit() and len(item) <= 10
    if digits and int(str(item)) < 2**32:
        return str(item)
    raise ContentError(f"property expiration must be milliseconds as digits, got {item!r}"[:200])


def _timestamp(item: object) -> dt.datetime:
    if isinstance(item, int) and not isinstance(item, bool) and 0 <= item < 2**63:
        try:
            return dt.datetime.fromtimestamp(item, dt.UTC)
        except (OverflowError, OSError, ValueError):
            pass
    elif isinstance(item, str) and len(item) <= 64:
        try:
            stamp = dt.datetime.fromisoformat(item)
        except ValueError:
            stamp = None
        if stamp is not None and stamp.tzinfo is not None:
            return stamp.astimezone(dt.UTC)
    raise ContentError(
        f"property timestamp must be epoch seconds or ISO 8601 with a timezone, got {item!r}"[:200]
    )


# ------------------------------------------------------------------------------ rows


class CheckedRow(NamedTuple):
    """The parts of a row a publish needs, each validated (a tuple: built once per row, on the
    publisher's and the enqueue API's hot paths, 0.3 µs against a frozen dataclass's 1.4)."""

    exchange: str
    routing_key: str
    message_id: str
    content_type: str | None
    headers: dict[str, Any]
    properties: dict[str, Any]


#: The characters an exchange name may hold: the publisher's AMQP codec (pamqp's domain rule for
#: ``exchange-name``) refuses any other at encode, so a row naming such an exchange ended
#: ``failed`` at publish with "Invalid value for exchange" (issue 48). Written out here, the pure
#: module imports no pamqp; ``tests/unit/test_content.py`` holds it equal to pamqp's.
EXCHANGE_NAME = re.compile(r"^[a-zA-Z0-9-_.:@#,/+ ]*$")


def check_exchange(value: object) -> str:
    """An exchange name: a ``shortstr`` (``""`` is the default exchange) of the characters the
    publisher can encode (:data:`EXCHANGE_NAME`)."""
    name = check_shortstr(value, what="exchange", empty_ok=True)
    if not EXCHANGE_NAME.match(name):
        raise ContentError(
            f"exchange {name[:80]!r} holds characters no publish can carry: letters, digits, "
            "space and - _ . : @ # , / + only"
        )
    return name


def check_row(
    *,
    exchange: object,
    routing_key: object,
    message_id: object,
    body: object,
    content_type: object,
    headers: object,
    properties: object,
    limits: Limits,
) -> CheckedRow:
    """Every field of a row a publish reads, checked in one place. Raises ContentError."""
    check_body(body, max_bytes=limits.max_body_bytes)
    ctype = None
    if content_type is not None:
        ctype = check_shortstr(content_type, what="content_type", empty_ok=True) or None
    return CheckedRow(
        exchange=check_exchange(exchange),
        routing_key=check_shortstr(routing_key, what="routing key", empty_ok=True),
        message_id=check_shortstr(message_id, what="message_id"),
        content_type=ctype,
        headers=check_headers(headers, max_bytes=limits.max_header_bytes),
        properties=check_properties(properties),
    )


def check_body(body: object, *, max_bytes: int) -> None:
    if not isinstance(body, bytes | bytearray | memoryview):
        raise ContentError(f"body must be bytes, got {_type(body)}")
    if len(body) > max_bytes:
        raise ContentError(f"body is {len(body)} bytes, larger than the limit of {max_bytes} bytes")
