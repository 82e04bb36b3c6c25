"""The wire client against the fake broker: handshake, framing, returns, closes, blocking."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pamqp import commands

from app.amqp.codec import OutgoingMessage, ReturnedMessage
from app.amqp.connection import AMQPConnection
from app.amqp.errors import CloseReason, ConnectionClosedError
from tests.support.fakebroker import FakeBroker


class Recorder:
    """A WireListener that keeps everything it hears."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []
        self.returns: list[ReturnedMessage] = []
        self.changed = asyncio.Event()

    def _note(self, *event: object) -> None:
        self.events.append(event)
        self.changed.set()

    def on_ack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        self._note("ack", channel_id, delivery_tag, multiple)

    def on_nack(self, channel_id: int, delivery_tag: int, multiple: bool) -> None:
        self._note("nack", channel_id, delivery_tag, multiple)

    def on_return(self, channel_id: int, message: ReturnedMessage) -> None:
        self.returns.append(message)
        self._note("return", channel_id, message.message_id)

    def on_channel_closed(self, channel_id: int, reason: CloseReason) -> None:
        self._note("channel_closed", channel_id, reason.reply_code, reason.reply_text)

    def on_blocked(self, reason: str) -> None:
        self._note("blocked", reason)

    def on_unblocked(self) -> None:
        self._note("unblocked")

    def on_connection_lost(self, reason: CloseReason) -> None:
        self._note("lost", reason.reply_code)

    async def wait(self, count: int) -> list[tuple[object, ...]]:
        async with asyncio.timeout(5):
            while len(self.events) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.events


def msg(i: int, body: bytes = b"x") -> OutgoingMessage:
    props = commands.Basic.Properties(message_id=f"m{i}", delivery_mode=2)
    return OutgoingMessage("", "q", body, props)


@pytest.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    async with FakeBroker(frame_max=4096) as fake:
        yield fake


async def test_handshake_announces_capabilities_and_honours_frame_max(broker: FakeBroker) -> None:
    rec = Recorder()
    conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=0)
    try:
        caps = broker.connection.client_properties["capabilities"]
        assert isinstance(caps, dict)
        for cap in (
            "publisher_confirms",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
        ):
            assert caps[cap] is True
        assert conn.frame_max == 4096
        assert conn.server_properties["product"] == "fakebroker"
    finally:
        await conn.close()


async def test_a_batch_is_one_write_and_big_bodies_are_split(broker: FakeBroker) -> None:
    rec = Recorder()
    conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=0)
    try:
        channel = await conn.open_channel()
        writes = conn.writes
        big = bytes(range(256)) * 40  # 10,240 bytes: three body frames at frame_max 4096
        errors = conn.publish_batch(channel, [msg(i) for i in range(200)] + [msg(200, big)])
        assert errors == [] and conn.writes == writes + 1
        pubs = await broker.wait_published(201)
        assert [p.tag for p in pubs] == list(range(1, 202))
        assert pubs[-1].body == big
        assert broker.connection.body_frames == 200 + 3
        assert broker.frame_errors == []
    finally:
        await conn.close()


async def test_unencodable_messages_are_left_out(broker: FakeBroker) -> None:
    rec = Recorder()
    conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=0)
    try:
        channel = await conn.open_channel()
        bad = OutgoingMessage("", "k" * 300, b"x", commands.Basic.Properties(message_id="bad"))
        errors = conn.publish_batch(channel, [msg(0), bad, msg(1)])
        assert [index for index, _ in errors] == [1]
        pubs = await broker.wait_published(2)
        assert [(p.message_id, p.tag) for p in pubs] == [("m0", 1), ("m1", 2)]
    finally:
        await conn.close()


async def test_acks_nacks_and_a_multi_frame_return_reach_the_listener(broker: FakeBroker) -> None:
    rec = Recorder()
    conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=0)
    try:
        channel = await conn.open_channel()
        big = b"r" * 9000
        conn.publish_batch(channel, [msg(0), msg(1, big), msg(2)])
        pubs = await broker.wait_published(3)
        pubs[1].send_return(312, "NO_ROUTE")
        pubs[0].ack()
        pubs[2].nack(multiple=True)
        events = await rec.wait(3)
        assert events == [
            ("return", channel, "m1"),
            ("ack", channel, 1, False),
            ("nack", channel, 3, True),
        ]
        returned = rec.returns[0]
        assert (returned.reply_code, returned.reply_text, returned.body) == (312, "NO_ROUTE", big)
    finally:
        await conn.close()


async def test_channel_close_is_answered_and_reported(broker: FakeBroker) -> None:
    rec = Recorder()
    conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=0)
    try:
        channel = await conn.open_channel()
        broker.connection.close_channel(channel, 406, "PRECONDITION_FAILED - test")
        assert await rec.wait(1) == [("channel_closed", channel, 406, "PRECONDITION_FAILED - test")]
        await broker.wait_for(lambda: channel not in broker.connection.channels)  # close-ok sent
        assert not conn.channel_is_open(channel)
        again = await conn.open_channel()
        assert again != channel
    finally:
        await conn.close()


async def test_passive_declare_on_a_scratch_channel(broker: FakeBroker) -> None:
    broker.missing_exchanges.add("gone")
    rec = Recorder()
    conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=0)
    try:
        channel = await conn.open_channel()
        missing = await conn.exchange_exists("gone")
        assert missing is not None and missing.reply_code == 404 and "gone" in missing.reply_text
        assert await conn.exchange_exists("here") is None
        assert conn.channel_is_open(channel)
        assert rec.events == []  # the scratch channel's close is not the publisher's business
    finally:
        await conn.close()


async def test_blocked_unblocked_and_connection_close(broker: FakeBroker) -> None:
    rec = Recorder()
    conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=0)
    broker.connection.block("low on disk")
    await rec.wait(1)
    assert conn.blocked
    broker.connection.unblock()
    await rec.wait(2)
    assert not conn.blocked
    broker.connection.close(320, "CONNECTION_FORCED - broker shutdown")
    events = await rec.wait(3)
    assert events == [("blocked", "low on disk"), ("unblocked",), ("lost", 320)]
    reason = await conn.wait_closed()
    assert reason.reply_text == "CONNECTION_FORCED - broker shutdown"
    with pytest.raises(ConnectionClosedError):
        conn.publish_batch(1, [msg(0)])


async def test_silent_broker_is_detected_by_heartbeats() -> None:
    async with FakeBroker(heartbeat=1) as broker:
        rec = Recorder()
        conn = await AMQPConnection.connect(broker.url, listener=rec, heartbeat=1)
        await asyncio.sleep(1.2)
        assert conn.is_open  # heartbeats flow both ways
        broker.connection.silence()
        async with asyncio.timeout(5):
            reason = await conn.wait_closed()
        assert "missed heartbeats" in reason.reply_text
        assert rec.events == [("lost", reason.reply_code)]
