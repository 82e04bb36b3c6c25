"""The pure parts of the publisher's wire layer: URL parsing, publish encoding, envelopes,
close classification, destination states. No loop, no sockets."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from app.amqp.codec import OutgoingMessage, PublishEncoder, marshal_properties
from app.amqp.params import parse_url
from app.outbox.records import Backoff, ClaimedRow
from app.publisher.destinations import Destinations, DestinationState
from app.publisher.envelope import EnvelopeError, to_message

_CONTENT_PREFIX = struct.pack(">HHQ", commands.Basic.frame_id, 0, 0)


def properties_of(message: OutgoingMessage) -> commands.Basic.Properties:
    """The properties of a message as a pamqp object (decoding them if marshalled)."""
    if isinstance(message.properties, commands.Basic.Properties):
        return message.properties
    content = header.ContentHeader()
    content.unmarshal(_CONTENT_PREFIX + message.properties)
    return content.properties


def decode_all(data: bytes) -> list[tuple[int, object]]:
    out = []
    while data:
        used, channel, value = frame.unmarshal(data)
        out.append((channel, value))
        data = data[used:]
    return out


def message(body: bytes = b"hello", **props: object) -> OutgoingMessage:
    return OutgoingMessage("ex", "rk", body, commands.Basic.Properties(**props), mandatory=True)


# ---------------------------------------------------------------- URLs


def test_parse_url_defaults_and_vhost() -> None:
    p = parse_url("amqp://u:p%40ss@broker:5673/")
    assert (p.host, p.port, p.vhost, p.username, p.password, p.tls) == (
        "broker",
        5673,
        "/",
        "u",
        "p@ss",
        False,
    )
    assert parse_url("amqp://h/prod%2Fa").vhost == "prod/a"
    assert parse_url("amqps://h").port == 5671 and parse_url("amqps://h").tls
    assert "p@ss" not in repr(parse_url("amqp://u:p%40ss@h/"))
    with pytest.raises(ValueError, match="not an AMQP URL"):
        parse_url("http://h/")


# ---------------------------------------------------------------- encoder


def test_encode_publish_method_header_body() -> None:
    out: list[bytes] = []
    PublishEncoder(frame_max=131_072).encode(
        3, message(b"body", message_id="m-1", delivery_mode=2, headers={"x-outbox-id": 7}), out
    )
    frames = decode_all(b"".join(out))
    assert [ch for ch, _ in frames] == [3, 3, 3]
    method, content, body = (value for _, value in frames)
    assert isinstance(method, commands.Basic.Publish)
    assert (method.exchange, method.routing_key, method.mandatory) == ("ex", "rk", True)
    assert isinstance(content, header.ContentHeader) and content.body_size == 4
    assert content.properties.message_id == "m-1"
    assert content.properties.headers == {"x-outbox-id": 7}
    assert isinstance(body, ContentBody) and body.value == b"body"


def test_empty_body_sends_no_body_frame() -> None:
    out: list[bytes] = []
    PublishEncoder(frame_max=4096).encode(1, message(b""), out)
    assert len(decode_all(b"".join(out))) == 2


@given(
    size=st.integers(min_value=0, max_value=20_000),
    frame_max=st.integers(min_value=4096, max_value=9000),
)
def test_bodies_split_at_frame_max(size: int, frame_max: int) -> None:
    body = bytes(i % 251 for i in range(size))
    out: list[bytes] = []
    PublishEncoder(frame_max=frame_max).encode(1, message(body), out)
    assert all(len(f) <= frame_max for f in out)
    frames = decode_all(b"".join(out))
    parts = [v.value for _, v in frames if isinstance(v, ContentBody)]
    assert b"".join(parts) == body
    assert len(parts) == -(-size // (frame_max - 8))


short = st.text(max_size=40) | st.none()
json_values = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=20)


@given(
    content_type=short,
    correlation_id=short,
    message_id=short,
    expiration=short,
    app_id=short,
    delivery_mode=st.sampled_from([None, 1, 2]),
    priority=st.integers(0, 255) | st.none(),
    headers=st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=4) | st.none(),
)
def test_marshal_properties_matches_pamqp(**values: object) -> None:
    """The hot path's property encoder writes exactly what pamqp's Basic.Properties writes."""
    assert marshal_properties(values) == commands.Basic.Properties(**values).marshal()


def test_method_frames_are_cached_per_destination() -> None:
    enc = PublishEncoder(frame_max=131_072)
    first = enc.publish_method(1, "ex", "rk", True)
    assert enc.publish_method(1, "ex", "rk", True) is first
    assert enc.publish_method(2, "ex", "rk", True) != first


@pytest.mark.parametrize(
    "bad",
    [
        OutgoingMessage("ex", "r" * 256, b"", commands.Basic.Properties()),
        OutgoingMessage("bad exchange!", "rk", b"", commands.Basic.Properties()),
    ],
)
def test_unencodable_publishes_raise(bad: OutgoingMessage) -> None:
    with pytest.raises(ValueError):
        PublishEncoder(frame_max=131_072).encode(1, bad, [])


# ---------------------------------------------------------------- envelope


def claimed(**kw: object) -> ClaimedRow:
    base: dict[str, object] = dict(
        id=42,
        message_id="m-42",
        batch_id="b",
        exchange="ex",
        routing_key="rk",
        mandatory=True,
        body=b"{}",
        content_type="application/json",
        headers={"tenant": "a"},
        properties=None,
        ordering_key=None,
        attempts=3,
        max_attempts=10,
    )
    return ClaimedRow(**{**base, **kw})  # type: ignore[arg-type]


def test_to_message_sets_id_headers_and_persistence() -> None:
    msg = to_message(claimed())
    p = properties_of(msg)
    assert (p.message_id, p.delivery_mode, p.content_type) == ("m-42", 2, "application/json")
    assert p.headers == {"tenant": "a", "x-outbox-id": 42, "x-outbox-attempt": 3}
    assert (msg.exchange, msg.routing_key, msg.mandatory, msg.body) == ("ex", "rk", True, b"{}")


def test_to_message_maps_row_properties() -> None:
    props = {
        "priority": 5,
        "expiration": 60000,
        "correlation_id": "c",
        "type": "order",
        "delivery_mode": 1,
        "app_id": "spark",
        "reply_to": "replies",
        "timestamp": 1_700_000_000,
    }
    p = properties_of(to_message(claimed(properties=props)))
    assert (p.priority, p.expiration, p.correlation_id, p.message_type, p.delivery_mode) == (
        5,
        "60000",
        "c",
        "order",
        1,
    )
    assert (p.app_id, p.reply_to, int(p.timestamp.timestamp())) == (
        "spark",
        "replies",
        1_700_000_000,
    )


def test_stored_json_text_is_read_like_decoded_json() -> None:
    p = properties_of(to_message(claimed(headers='{"tenant": "b"}', properties='{"priority": 1}')))
    assert p.headers == {"tenant": "b", "x-outbox-id": 42, "x-outbox-attempt": 3}
    assert p.priority == 1


@pytest.mark.parametrize(
    "props",
    [
        {"expiration": "soon"},
        {"priority": 300},
        {"delivery_mode": 3},
        {"user_id": "mallory"},  # RabbitMQ would close the channel on a foreign user_id
    ],
)
def test_invalid_properties_are_permanent_errors(props: dict[str, object]) -> None:
    with pytest.raises(EnvelopeError):
        to_message(claimed(properties=props))


# ---------------------------------------------------------------- destinations


def test_destination_lifecycle() -> None:
    d = Destinations(backoff=Backoff(base=1.0, cap=8.0), ok_ttl=10.0)
    assert d.state("", 0.0) is DestinationState.OK  # the default exchange always exists
    assert d.state("ex", 0.0) is DestinationState.UNKNOWN
    d.checking("ex")
    assert d.state("ex", 100.0) is DestinationState.CHECKING
    d.ok("ex", 0.0)
    assert d.state("ex", 9.9) is DestinationState.OK
    assert d.state("ex", 10.0) is DestinationState.UNKNOWN  # checked again after the TTL


def test_failed_destination_backs_off_exponentially() -> None:
    d = Destinations(backoff=Backoff(base=1.0, cap=8.0), ok_ttl=10.0)
    delays = [d.failed("gone", "404", 0.0) for _ in range(5)]
    assert all(0.5 * c <= got <= c for got, c in zip(delays, [1, 2, 4, 8, 8], strict=True))
    assert d.state("gone", 0.0) is DestinationState.PAUSED
    assert d.reason("gone") == "404"
    assert d.state("gone", 8.1) is DestinationState.UNKNOWN
    assert d.paused(0.0).keys() == {"gone"}


def test_a_check_that_did_not_run_waits_a_backoff_then_runs_again() -> None:
    """It used to be forgotten at once: the rows parked again and a new check started, in a
    loop that burnt a core when no channel was free for checks (channel_max 1)."""
    d = Destinations(backoff=Backoff(base=1.0, cap=8.0), ok_ttl=10.0)
    d.checking("ex")
    first = d.unchecked("ex", 0.0)
    assert 0.5 <= first <= 1.0 and d.state("ex", 100.0) is DestinationState.CHECKING
    d.recheck("ex")
    assert d.state("ex", 0.0) is DestinationState.UNKNOWN
    d.checking("ex")
    assert 1.0 <= d.unchecked("ex", 0.0) <= 2.0  # backs off further
