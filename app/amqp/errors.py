"""Errors of the AMQP client, split by blame, and the reply codes the publisher acts on.

::

    WireError                     base of everything the client raises
    ├── ConnectionClosedError     the connection is closed or lost (``reason`` says why)
    ├── ChannelClosedError        a channel is closed (``reason`` says why)
    ├── HandshakeError            the broker refused or broke the connection handshake
    │   ├── AuthenticationError   the broker refused the credentials
    │   └── TLSError              the broker refused our TLS session (our client certificate)
    └── ChannelLimitError         every channel number the broker allows is in use
"""

from __future__ import annotations

from dataclasses import dataclass

REPLY_SUCCESS = 200
CONNECTION_FORCED = 320
ACCESS_REFUSED = 403
NOT_FOUND = 404
PRECONDITION_FAILED = 406
FRAME_ERROR = 501
SYNTAX_ERROR = 502
COMMAND_INVALID = 503
CHANNEL_ERROR = 504
UNEXPECTED_FRAME = 505
RESOURCE_ERROR = 506
NOT_ALLOWED = 530
INTERNAL_ERROR = 541
#: Connection-level closes a message's content can provoke (a frame or a value the broker cannot
#: take): the publisher blames the publishes written just before such a close.
CONTENT_ERRORS = frozenset({FRAME_ERROR, SYNTAX_ERROR, COMMAND_INVALID, UNEXPECTED_FRAME})


@dataclass(frozen=True, slots=True)
class CloseReason:
    """Why a channel or the connection closed (``by_peer``: the broker closed it)."""

    reply_code: int
    reply_text: str
    class_id: int = 0
    method_id: int = 0
    by_peer: bool = True

    def __str__(self) -> str:
        return f"{self.reply_code} {self.reply_text}"


class WireError(Exception):
    """Base of the AMQP client's errors."""


class ConnectionClosedError(WireError):
    """The connection is closed or lost; ``reason`` says why."""

    def __init__(self, reason: CloseReason) -> None:
        super().__init__(f"connection closed: {reason}")
        self.reason = reason


class BrokerUnreachableError(WireError):
    """No broker of the URL could be connected to (each one's reason is in the message): a
    refused or timed-out TCP connection, a TLS certificate not trusted, a wrong host name."""


class ChannelClosedError(WireError):
    """The channel is closed; ``reason`` says why."""

    def __init__(self, channel_id: int, reason: CloseReason) -> None:
        super().__init__(f"channel {channel_id} closed: {reason}")
        self.channel_id = channel_id
        self.reason = reason


class HandshakeError(WireError):
    """The broker refused or broke the connection handshake."""


class AuthenticationError(HandshakeError):
    """The broker refused the credentials (403 during the handshake)."""


class TLSError(HandshakeError):
    """The broker refused the TLS session or dropped it before the AMQP handshake (with TLS 1.3,
    how a client certificate it does not trust is refused); the message says which."""


class ChannelLimitError(WireError):
    """Every channel number up to the broker's ``channel_max`` is in use."""
