"""Outbox row -> AMQP message. Pure functions, no I/O.

Every field of the row is untrusted: :func:`to_message` checks it through
:func:`app.outbox.content.check_row` (bounded JSON, header names and depth, properties, sizes)
and refuses with an :class:`EnvelopeError` (the row ends ``failed`` with that reason, alone).
"""

from __future__ import annotations

from app.amqp.codec import ENCODE_ERRORS, OutgoingMessage, marshal_properties
from app.outbox.content import ContentError, Limits, check_row
from app.outbox.records import ClaimedRow

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
            exchange=row.exchange,
            routing_key=row.routing_key,
            message_id=row.message_id,
            body=row.body,
            content_type=row.content_type,
            headers=row.headers,
            properties=row.properties,
            limits=limits,
        )
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
