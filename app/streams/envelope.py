"""Outbox row -> a stream message (AMQP 1.0, as RabbitMQ streams store them). Pure, no I/O.

The row is checked as for an exchange (``app.outbox.content.check_row``): a row that cannot be
a message ends ``failed`` with the reason, alone. A stream row names no exchange or routing key:
a row that does is refused (it was meant for an exchange, or the writer mixed the two).

What the message carries: the body; ``message_id``, ``content_type``, ``correlation_id``,
``reply_to`` and ``user_id`` as AMQP 1.0 properties, the creation time (``timestamp`` if the row
gives one, else its ``created_at``); the headers as application properties, with
``x-outbox-id``; a header whose value is a list or an object becomes its JSON text (AMQP 1.0
application properties are simple values).
"""

from __future__ import annotations

import datetime as dt
import json
import struct
from typing import Any

from rstream._pyamqp.message import Properties  # type: ignore[attr-defined]
from rstream.amqp import AMQPMessage

from app.outbox.content import ContentError, Limits, check_row
from app.publisher.envelope import OUTBOX_ID_HEADER

DEFAULT_LIMITS = Limits()


class StreamEnvelopeError(ValueError):
    """The row cannot become a stream message: a permanent error for that row."""


def _simple(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return value


def to_stream_message(row: Any, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The encoded message for a claimed stream row. Raises StreamEnvelopeError."""
    if row.exchange or row.routing_key:
        raise StreamEnvelopeError(
            "a row for a stream names no exchange or routing key "
            f"(got exchange {row.exchange!r}, routing key {row.routing_key!r})"
        )
    try:
        checked = check_row(
            exchange="",
            routing_key="",
            message_id=row.message_id,
            body=row.body,
            content_type=row.content_type,
            headers=row.headers,
            properties=row.properties,
            limits=limits,
        )
    except ContentError as exc:
        raise StreamEnvelopeError(str(exc)) from None
    props = checked.properties
    stamp = props.get("timestamp")
    if isinstance(stamp, dt.datetime):
        created = int(stamp.timestamp() * 1000)
    elif isinstance(stamp, int):
        created = stamp * 1000
    elif row.created_at is not None:
        created = int(row.created_at.timestamp() * 1000)
    else:
        created = None
    user_id = props.get("user_id")
    properties = Properties(
        message_id=checked.message_id,
        content_type=checked.content_type,
        correlation_id=props.get("correlation_id"),
        reply_to=props.get("reply_to"),
        user_id=user_id.encode() if isinstance(user_id, str) else user_id,
        creation_time=created,
    )
    app_props = {str(k): _simple(v) for k, v in checked.headers.items()}
    app_props[OUTBOX_ID_HEADER] = row.id
    message = AMQPMessage(
        body=bytes(row.body), properties=properties, application_properties=app_props
    )
    try:
        return bytes(message)
    except (TypeError, ValueError, OverflowError, struct.error) as exc:
        raise StreamEnvelopeError(f"cannot encode the message: {exc}") from exc
