"""Outbox row -> AMQP message, and what the broker's close replies mean. Pure functions, no I/O.

Every field of the row is untrusted: :func:`to_message` checks it through
:func:`app.outbox.content.check_row` (bounded JSON, header names and depth, properties, sizes)
and refuses with an :class:`EnvelopeError` (the row ends ``failed`` with that reason, alone).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import StrEnum

from pamqp import commands, header

from app.amqp.codec import ENCODE_ERRORS, OutgoingMessage, marshal_properties
from app.amqp.errors import ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED, CloseReason
from app.outbox.content import ContentError, Limits, check_row
from app.outbox.repository import ClaimedRow

_CONTENT_PREFIX = struct.pack(">HHQ", commands.Basic.frame_id, 0, 0)
OUTBOX_ID_HEADER = "x-outbox-id"
OUTBOX_ATTEMPT_HEADER = "x-outbox-attempt"
DEFAULT_LIMITS = Limits()


class EnvelopeError(ValueError):
    """The row cannot become a valid AMQP message: a permanent error for that row."""


def to_message(row: ClaimedRow, *, limits: Limits = DEFAULT_LIMITS) -> OutgoingMessage:
    """The publish for a claimed row: persistent unless the row says otherwise, ``message_id``
    set, headers ``x-outbox-id`` / ``x-outbox-attempt`` added. Raises EnvelopeError."""
    try:
        checked = check_row(
            exchange=row.exchange, routing_key=row.routing_key, message_id=row.message_id,
            body=row.body, content_type=row.content_type, headers=row.headers,
            properties=row.properties, limits=limits,
        )  # fmt: skip
    except ContentError as exc:
        raise EnvelopeError(str(exc)) from None
    headers = dict(checked.headers)
    headers[OUTBOX_ID_HEADER] = row.id
    headers[OUTBOX_ATTEMPT_HEADER] = row.attempts
    values = checked.properties
    values["content_type"] = checked.content_type
    values["headers"] = headers
    values["message_id"] = checked.message_id
    try:
        props = marshal_properties(values)
    except ENCODE_ERRORS as exc:
        raise EnvelopeError(f"invalid message properties: {exc}") from exc
    return OutgoingMessage(checked.exchange, checked.routing_key, row.body, props, row.mandatory)


def properties_of(message: OutgoingMessage) -> commands.Basic.Properties:
    """The properties of a message as a pamqp object (decoding them if marshalled)."""
    if isinstance(message.properties, commands.Basic.Properties):
        return message.properties
    content = header.ContentHeader()
    content.unmarshal(_CONTENT_PREFIX + message.properties)
    return content.properties


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
