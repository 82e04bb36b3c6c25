"""One row never stops the rest, at any level, against the real RabbitMQ: headers too large for
the negotiated frame size, a row that makes the broker close the whole connection, and a broker
that allows one channel.

Before (issue 12): a row whose content header exceeded frame_max made the broker close the
connection (501); the publisher reconnected and resent it forever (25 connections in 20 s, 0 of 61
rows confirmed). With channel_max 1 the exchange check wanted a second channel: no publish in
20 s and a core burnt; with OUTBOX_CHANNELS=3 it reconnected in a loop.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine

from app.amqp.codec import FrameSizeError, PublishEncoder
from app.amqp.connection import AMQPConnection
from tests.support.factories import add_rows
from tests.support.publisher import (
    consume_ids,
    rows,
    run_until_empty,
    settings_for,
)

BIG_HEADERS = json.dumps({"blob": "x" * 200_000})  # over RabbitMQ's frame_max of 131072


def add_big(engine: Engine, exchange: str) -> None:
    add_rows(engine, n=1, exchange=exchange, prefix="big", headers=json.loads(BIG_HEADERS))


def _statuses(engine: Engine) -> dict[str, str]:
    return {r.message_id: r.status for r in rows(engine)}


async def test_headers_over_the_limit_fail_that_row_only(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    good = add_rows(engine, n=30, exchange=topology["exchange"], prefix="good")
    add_rows(
        engine, n=1, exchange=topology["exchange"], prefix="big", headers=json.loads(BIG_HEADERS)
    )
    stats = await run_until_empty(settings_for(db_url=db_url, amqp_url=amqp_url), engine)
    final = {r.message_id: r for r in rows(engine)}
    assert all(final[m].status == "confirmed" for m in good)
    assert final["big-0"].status == "failed"
    assert "over the 65536-byte limit" in (final["big-0"].last_error or "")
    assert stats.reconnects == 0


async def test_headers_over_the_frame_size_fail_at_encode_that_row_only(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """Allowed by OUTBOX_MAX_HEADER_BYTES, too big for one frame of the broker's frame_max:
    refused when encoding, never sent (the broker would close the whole connection)."""
    good = add_rows(engine, n=30, exchange=topology["exchange"], prefix="good")
    add_rows(
        engine, n=1, exchange=topology["exchange"], prefix="big", headers=json.loads(BIG_HEADERS)
    )
    settings = settings_for(db_url=db_url, amqp_url=amqp_url, max_header_bytes=1024 * 1024)
    stats = await run_until_empty(settings, engine)
    final = {r.message_id: r for r in rows(engine)}
    assert all(final[m].status == "confirmed" for m in good)
    assert final["big-0"].status == "failed"
    assert "frame_max (131072 bytes)" in (final["big-0"].last_error or "")
    assert stats.reconnects == 0


async def test_a_connection_closed_by_the_broker_is_blamed_on_one_row(
    db_url: str,
    engine: Engine,
    amqp_url: str,
    topology: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the encoder's frame check switched off, the oversized header reaches the real
    broker, which closes the connection (501 FRAME_ERROR) with the window outstanding. The
    quarantine finds the row: it ends failed, every other row is confirmed exactly once."""
    real_encode = PublishEncoder.encode

    def unchecked(self: PublishEncoder, channel_id: int, message: Any, out: list[bytes]) -> None:
        saved, self.body_chunk = self.body_chunk, 10**9  # no frame-size refusal
        try:
            real_encode(self, channel_id, message, out)
        finally:
            self.body_chunk = saved

    monkeypatch.setattr(PublishEncoder, "encode", unchecked)
    good = add_rows(engine, n=150, exchange=topology["exchange"], prefix="good-a")
    add_rows(
        engine, n=1, exchange=topology["exchange"], prefix="big", headers=json.loads(BIG_HEADERS)
    )
    good += add_rows(engine, n=150, exchange=topology["exchange"], prefix="good-b")
    settings = settings_for(db_url=db_url, amqp_url=amqp_url, max_header_bytes=1024 * 1024)
    stats = await run_until_empty(settings, engine)
    final = {r.message_id: r for r in rows(engine)}
    assert [m for m, r in final.items() if r.status != "confirmed"] == ["big-0"]
    assert final["big-0"].status == "failed"
    assert "alone 3 times" in (final["big-0"].last_error or "")
    assert "501" in (final["big-0"].last_error or "")
    assert 1 <= stats.reconnects <= 20
    seen = await consume_ids(amqp_url, topology["queue"], expect=len(good))
    assert set(seen) == set(good)  # each good row arrived (duplicates only from the closes)


def test_the_encoder_refuses_what_one_frame_cannot_carry() -> None:
    from app.amqp.codec import OutgoingMessage, marshal_properties

    props = marshal_properties({"headers": json.loads(BIG_HEADERS)})
    with pytest.raises(FrameSizeError, match="frame_max"):
        PublishEncoder(frame_max=131_072).encode(1, OutgoingMessage("ex", "rk", b"", props), [])


@pytest.mark.parametrize("channels", [1, 3])
async def test_a_broker_allowing_one_channel_still_drains(
    channels: int,
    db_url: str,
    engine: Engine,
    amqp_url: str,
    topology: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """channel_max 1 (negotiated with the real broker): publishing, exchange checks on the one
    channel, and a missing exchange backing off, with OUTBOX_CHANNELS 1 and 3."""
    real_connect = AMQPConnection.connect.__func__  # type: ignore[attr-defined]

    async def one_channel(cls: type[AMQPConnection], url: str, **kw: Any) -> AMQPConnection:
        conn: AMQPConnection = await real_connect(cls, url, **{**kw, "channel_max": 1})
        assert conn.channel_max == 1
        return conn

    monkeypatch.setattr(AMQPConnection, "connect", classmethod(one_channel))
    good = add_rows(engine, n=500, exchange=topology["exchange"], prefix="good")
    add_rows(engine, n=5, exchange=f"missing-{uuid.uuid4().hex[:6]}", prefix="lost")
    settings = settings_for(
        db_url=db_url, amqp_url=amqp_url, channels=channels, destination_retry_budget=2
    )
    async with asyncio.timeout(30):
        stats = await run_until_empty(settings, engine)
    final = _statuses(engine)
    assert all(final[m] == "confirmed" for m in good)
    assert all(final[f"lost-{i}"] == "failed" for i in range(5))
    assert stats.reconnects == 0
    seen = await consume_ids(amqp_url, topology["queue"], expect=500)
    assert set(seen) == set(good) and seen.total() == 500  # no channel lost: no duplicate
