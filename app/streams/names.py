"""Stream names as RabbitMQ takes them (a queue's name). Standard library only: the message
model (``app.outbox.message``) checks them without loading a stream client."""

from __future__ import annotations

import re

#: No control characters in a name.
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")


class StreamNameError(ValueError):
    """A stream name RabbitMQ would refuse (the message says why)."""


def check_stream_name(name: object) -> str:
    """``name`` if RabbitMQ takes it as a stream's name: a non-empty string of at most 255
    bytes, no control characters, not in the reserved ``amq.`` namespace."""
    if not isinstance(name, str) or not name:
        raise StreamNameError("a stream name must be a non-empty string")
    size = len(name.encode())
    if size > 255:
        raise StreamNameError(f"a stream name is at most 255 bytes; this one is {size}")
    if _BAD_NAME.search(name):
        raise StreamNameError("a stream name must not contain control characters")
    if name.startswith("amq."):
        raise StreamNameError(f"stream name {name!r}: names starting 'amq.' are reserved")
    return name
