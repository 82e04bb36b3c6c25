"""The pure half of the AMQP client: frames in and out, no sockets, no event loop.

pamqp marshals and unmarshals every method frame; this module adds what the publish hot path needs
on top of it: content-header properties marshalled with pamqp's own encoders but without building a
``Basic.Properties`` per message (:func:`marshal_properties`), the ``basic.publish`` method frame
built once per destination (:class:`PublishEncoder`), bodies split at ``frame_max``, and an
incremental frame reader (:class:`FrameReader`) for what the broker sends.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pamqp import commands, constants, encode, frame, header, heartbeat
from pamqp.base import Frame
from pamqp.exceptions import PAMQPException

PROTOCOL_HEADER = header.ProtocolHeader().marshal()
HEARTBEAT_FRAME = heartbeat.Heartbeat.marshal()
DEFAULT_FRAME_MAX = 131_072
FRAME_OVERHEAD = 8  # type (1) + channel (2) + size (4) + frame-end (1)
_FRAME_HEADER = struct.Struct(">BHI")
_CONTENT_HEADER = struct.Struct(">HxxQ")
_PROPERTY_FLAGS = struct.Struct(">H")
_FRAME_END = constants.FRAME_END_CHAR
_METHOD_CACHE_MAX = 4096
ENCODE_ERRORS = (ValueError, TypeError, PAMQPException, struct.error, OverflowError)


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """One ``basic.publish`` with its content.

    ``properties``: a pamqp ``Basic.Properties``, or bytes already marshalled by
    :func:`marshal_properties` (the hot path's form).
    """

    exchange: str
    routing_key: str
    body: bytes
    properties: commands.Basic.Properties | bytes
    mandatory: bool = True


@dataclass(frozen=True, slots=True)
class ReturnedMessage:
    """A ``basic.return`` with its content header and body, assembled."""

    reply_code: int
    reply_text: str
    exchange: str
    routing_key: str
    properties: commands.Basic.Properties
    body: bytes

    @property
    def message_id(self) -> str | None:
        return self.properties.message_id


class FrameSizeError(ValueError):
    """A publish whose content header cannot fit one frame of the negotiated ``frame_max``."""


def frame_bytes(frame_type: int, channel_id: int, payload: bytes) -> bytes:
    return _FRAME_HEADER.pack(frame_type, channel_id, len(payload)) + payload + _FRAME_END


def method_frame(channel_id: int, method: Frame) -> bytes:
    """One marshalled method frame (pamqp's codec)."""
    return frame.marshal(method, channel_id)


def _property_codecs() -> tuple[tuple[str, int, Callable[[Any], bytes]], ...]:
    props = commands.Basic.Properties
    encoders: dict[str, Callable[[Any], bytes]] = {
        "shortstr": encode.short_string,
        "octet": encode.octet,
        "table": encode.field_table,
        "timestamp": encode.timestamp,
    }
    return tuple(
        (name, props.flags[name], encoders[props.amqp_type(name)])
        for name in props.attributes()
        if name != "cluster_id"
    )


_PROPERTY_CODECS = _property_codecs()


def marshal_properties(values: Mapping[str, Any]) -> bytes:
    """Content-header properties, as ``Basic.Properties(**values).marshal()`` encodes them.

    Same flags and value encoders (pamqp's), without building and reflecting over a
    ``Basic.Properties`` per message. Keys are ``Basic.Properties`` attribute names; no validation
    beyond the encoders' own (callers check values first: ``app.outbox.content``).
    """
    flags = 0
    parts: list[bytes] = []
    for name, flag, encoder in _PROPERTY_CODECS:
        value = values.get(name)
        if value is not None and value != "":
            flags |= flag
            parts.append(encoder(value))
    return _PROPERTY_FLAGS.pack(flags) + b"".join(parts)


class PublishEncoder:
    """Marshals ``basic.publish`` + content header + body frames for one connection.

    The method frame of a (channel, exchange, routing key, mandatory) is built once by pamqp and
    cached; bodies are split at ``frame_max - 8``; a content header (properties and headers) must
    fit one frame, or the broker closes the whole connection (501): refused here instead.
    """

    def __init__(self, *, frame_max: int) -> None:
        self.frame_max = frame_max or DEFAULT_FRAME_MAX
        self.body_chunk = self.frame_max - FRAME_OVERHEAD
        self._methods: dict[tuple[int, str, str, bool], bytes] = {}

    def publish_method(
        self, channel_id: int, exchange: str, routing_key: str, mandatory: bool
    ) -> bytes:
        key = (channel_id, exchange, routing_key, mandatory)
        cached = self._methods.get(key)
        if cached is None:
            if len(self._methods) >= _METHOD_CACHE_MAX:
                self._methods.clear()
            method = commands.Basic.Publish(
                exchange=exchange, routing_key=routing_key, mandatory=mandatory
            )
            cached = self._methods[key] = frame.marshal(method, channel_id)
        return cached

    def encode(self, channel_id: int, message: OutgoingMessage, out: list[bytes]) -> None:
        """Append the frames of one publish to ``out``; one of ENCODE_ERRORS if unencodable."""
        if len(message.routing_key.encode()) > 255:
            raise ValueError("routing key longer than 255 bytes")
        body = message.body
        props = message.properties
        if not isinstance(props, bytes):
            props = props.marshal()
        content_header = _CONTENT_HEADER.pack(commands.Basic.frame_id, len(body)) + props
        if len(content_header) > self.body_chunk:
            raise FrameSizeError(
                f"properties and headers take {len(content_header)} bytes, more than one frame "
                f"of the broker's frame_max ({self.frame_max} bytes) can carry"
            )
        method = self.publish_method(
            channel_id, message.exchange, message.routing_key, message.mandatory
        )
        out.append(method)
        out.append(frame_bytes(constants.FRAME_HEADER, channel_id, content_header))
        step = self.body_chunk
        if len(body) <= step:
            if body:
                out.append(frame_bytes(constants.FRAME_BODY, channel_id, body))
            return
        for start in range(0, len(body), step):
            out.append(frame_bytes(constants.FRAME_BODY, channel_id, body[start : start + step]))

    def encode_batch(
        self, channel_id: int, messages: Sequence[OutgoingMessage]
    ) -> tuple[bytes, list[tuple[int, Exception]]]:
        """Marshal publishes into one buffer (nothing is sent).

        Returns the bytes and ``(index, error)`` for messages that could not be encoded: those
        are left out, so they take no delivery tag.
        """
        out: list[bytes] = []
        errors: list[tuple[int, Exception]] = []
        encode_one = self.encode
        for index, message in enumerate(messages):
            mark = len(out)
            try:
                encode_one(channel_id, message, out)
            except ENCODE_ERRORS as exc:
                del out[mark:]
                errors.append((index, exc))
        return b"".join(out), errors


class FramingError(ValueError):
    """The byte stream from the broker is not AMQP frames (a protocol violation)."""


class FrameReader:
    """Incremental reader: feed bytes, get ``(channel, frame value)`` pairs; heartbeats dropped.

    ``None`` as a value stands for a heartbeat frame (the caller only needs to know one came).
    Raises :class:`FramingError` on a frame without its end octet or an undecodable payload.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, Any]]:
        buf = self._buffer
        buf += data
        offset, size = 0, len(buf)
        try:
            while size - offset >= 8:
                frame_type, channel_id, length = _FRAME_HEADER.unpack_from(buf, offset)
                end = offset + 7 + length + 1
                if end > size:
                    break
                if buf[end - 1] != constants.FRAME_END:
                    raise FramingError("frame does not end with 0xCE")
                chunk = bytes(buf[offset:end])
                offset = end
                if frame_type == constants.FRAME_HEARTBEAT:
                    continue
                try:
                    _, _, value = frame.unmarshal(chunk)
                except PAMQPException as exc:
                    raise FramingError(f"undecodable frame: {exc}") from exc
                yield channel_id, value
        finally:
            del buf[:offset]

    def starts_with_protocol_header(self, data: bytes) -> bool:
        """A broker answering our header with its own (``AMQP``…) wants another protocol."""
        return not self._buffer and data[:4] == b"AMQP"


@dataclass(slots=True)
class _Assembly:
    """A ``basic.return`` whose content frames are still arriving."""

    method: commands.Basic.Return
    properties: commands.Basic.Properties | None = None
    size: int = -1
    parts: list[bytes] = field(default_factory=list)
    received: int = 0


class ReturnAssembler:
    """``basic.return`` frames, then their content header and body frames, per channel, into
    :class:`ReturnedMessage` s. Content of anything else (a delivery) is ignored."""

    def __init__(self) -> None:
        self._assembling: dict[int, _Assembly] = {}

    def start(self, channel_id: int, method: commands.Basic.Return) -> None:
        self._assembling[channel_id] = _Assembly(method)

    def drop(self, channel_id: int) -> None:
        """The channel closed: a return in progress on it is dropped."""
        self._assembling.pop(channel_id, None)

    def header(self, channel_id: int, value: header.ContentHeader) -> ReturnedMessage | None:
        pending = self._assembling.get(channel_id)
        if pending is None:
            return None
        pending.properties = value.properties
        pending.size = value.body_size
        return self._finish(channel_id, pending) if pending.size == 0 else None

    def body(self, channel_id: int, data: bytes) -> ReturnedMessage | None:
        pending = self._assembling.get(channel_id)
        if pending is None or pending.size < 0:
            return None
        pending.parts.append(data)
        pending.received += len(data)
        return self._finish(channel_id, pending) if pending.received >= pending.size else None

    def _finish(self, channel_id: int, pending: _Assembly) -> ReturnedMessage:
        del self._assembling[channel_id]
        method = pending.method
        return ReturnedMessage(
            reply_code=method.reply_code or 0,
            reply_text=method.reply_text or "",
            exchange=method.exchange or "",
            routing_key=method.routing_key or "",
            properties=pending.properties or commands.Basic.Properties(),
            body=b"".join(pending.parts),
        )
