"""The AMQP 0-9-1 client of the publish hot path, on pamqp's frame codec.

- :mod:`app.amqp.codec`: pure frames in and out (publish encoding, properties, frame reader);
- :mod:`app.amqp.connection`: the asyncio connection, its channels and the broker's callbacks;
- :mod:`app.amqp.params`: URLs to connection parameters;
- :mod:`app.amqp.errors`: the error hierarchy and reply codes.
"""

from app.amqp.codec import (
    DEFAULT_FRAME_MAX,
    FrameSizeError,
    OutgoingMessage,
    PublishEncoder,
    ReturnedMessage,
    marshal_properties,
)
from app.amqp.connection import AMQPConnection, WireListener
from app.amqp.errors import (
    AuthenticationError,
    BrokerUnreachableError,
    ChannelClosedError,
    ChannelLimitError,
    CloseReason,
    ConnectionClosedError,
    HandshakeError,
    TLSError,
    WireError,
)
from app.amqp.params import AMQPParams, TLSOptions, URLError, parse_url

__all__ = [
    "DEFAULT_FRAME_MAX",
    "AMQPConnection",
    "AMQPParams",
    "AuthenticationError",
    "BrokerUnreachableError",
    "ChannelClosedError",
    "ChannelLimitError",
    "CloseReason",
    "ConnectionClosedError",
    "FrameSizeError",
    "HandshakeError",
    "OutgoingMessage",
    "PublishEncoder",
    "ReturnedMessage",
    "TLSError",
    "TLSOptions",
    "URLError",
    "WireError",
    "WireListener",
    "marshal_properties",
    "parse_url",
]
