"""Outbox row -> AMQP message, and what the broker's close replies mean. Pure functions, no I/O."""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pamqp import commands, header

from app.outbox.repository import ClaimedRow
from app.publisher.wire import (
    ACCESS_REFUSED,
    NOT_FOUND,
    PRECONDITION_FAILED,
    CloseReason,
    OutgoingMessage,
    marshal_properties,
)

PERSISTENT = 2
_CONTENT_PREFIX = struct.pack(">HHQ", commands.Basic.frame_id, 0, 0)
OUTBOX_ID_HEADER = "x-outbox-id"
OUTBOX_ATTEMPT_HEADER = "x-outbox-attempt"

#: row ``properties`` keys -> Basic.Properties attributes. ``user_id`` is left out on purpose:
#: RabbitMQ closes the channel (406) when it differs from the login, which would void the window.
_PROPERTY_NAMES = {
    "priority": "priority", "expiration": "expiration", "correlation_id": "correlation_id",
    "type": "message_type", "message_type": "message_type", "delivery_mode": "delivery_mode",
    "reply_to": "reply_to", "app_id": "app_id", "content_encoding": "content_encoding",
}  # fmt: skip


class EnvelopeError(ValueError):
    """The row cannot become a valid AMQP message: a permanent error for that row."""


def to_message(row: ClaimedRow) -> OutgoingMessage:
    """The publish for a claimed row: persistent unless the row says otherwise, ``message_id``
    set, headers ``x-outbox-id`` / ``x-outbox-attempt`` added. Raises EnvelopeError."""
    headers: dict[str, Any] = dict(row.headers) if row.headers else {}
    headers[OUTBOX_ID_HEADER] = row.id
    headers[OUTBOX_ATTEMPT_HEADER] = row.attempts
    values: dict[str, Any] = (
        _properties(row.properties) if row.properties else {"delivery_mode": PERSISTENT}
    )
    values["content_type"] = row.content_type
    values["headers"] = headers
    values["message_id"] = row.message_id
    try:
        props = marshal_properties(values)
    except (TypeError, ValueError, struct.error) as exc:
        raise EnvelopeError(f"invalid message properties: {exc}") from exc
    return OutgoingMessage(row.exchange, row.routing_key, row.body, props, row.mandatory)


def properties_of(message: OutgoingMessage) -> commands.Basic.Properties:
    """The properties of a message as a pamqp object (decoding them if marshalled)."""
    if isinstance(message.properties, commands.Basic.Properties):
        return message.properties
    content = header.ContentHeader()
    content.unmarshal(_CONTENT_PREFIX + message.properties)
    return content.properties


def _properties(given: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"delivery_mode": PERSISTENT}
    for key, value in given.items():
        name = _PROPERTY_NAMES.get(key)
        if name is None or value is None:
            continue
        out[name] = value
    if "expiration" in out:
        out["expiration"] = _expiration(out["expiration"])
    for name, allowed in (("priority", range(256)), ("delivery_mode", (1, 2))):
        value = out.get(name)
        if value is not None and (not isinstance(value, int) or value not in allowed):
            raise EnvelopeError(f"{name} must be one of {allowed}, got {value!r}")
    return out


def _expiration(value: Any) -> str:
    """RabbitMQ closes the channel (406) on a non-numeric expiration: refuse it here instead."""
    text = str(value)
    if not text.isdigit():
        raise EnvelopeError(f"expiration must be milliseconds as digits, got {value!r}")
    return text


# ---------------------------------------------------------------- channel closes


class CloseKind(StrEnum):
    DESTINATION = "destination"  # 404 no exchange / 403 access refused to an exchange
    OVERSIZED = "oversized"  # 406 message larger than the broker's max_message_size
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class CloseCause:
    """What a channel close tells the engine: whom to blame."""

    kind: CloseKind
    exchange: str | None = None
    max_size: int | None = None


_EXCHANGE_IN_TEXT = re.compile(r"exchange '((?:[^'\\]|\\.)*)' in vhost")
_MAX_SIZE_IN_TEXT = re.compile(r"larger than configured max size (\d+)")


def classify_close(reason: CloseReason) -> CloseCause:
    """Read the reply code and text of a broker ``channel.close``.

    ``NOT_FOUND - no exchange 'x' in vhost '/'`` and ``ACCESS_REFUSED - access to exchange 'x'
    in vhost '/' refused for user 'u'`` blame exchange ``x``; ``PRECONDITION_FAILED - message
    size 200 is larger than configured max size 100`` blames the bodies above 100 bytes.
    """
    text = reason.reply_text
    if reason.reply_code in (NOT_FOUND, ACCESS_REFUSED):
        match = _EXCHANGE_IN_TEXT.search(text)
        if match is not None:
            return CloseCause(CloseKind.DESTINATION, exchange=match.group(1))
    if reason.reply_code == PRECONDITION_FAILED:
        match = _MAX_SIZE_IN_TEXT.search(text)
        if match is not None:
            return CloseCause(CloseKind.OVERSIZED, max_size=int(match.group(1)))
    return CloseCause(CloseKind.OTHER)
