"""The real Publisher against the scriptable fake broker, with a real database.

Each case is a broker behaviour RabbitMQ will not produce on demand; the test script plays the
broker's side and then checks the rows. Real-broker tests of the same outcomes live in
test_publisher_*.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import Engine

from app.db import make_engine
from tests.support.factories import add_rows
from tests.support.fakebroker import FakeBroker
from tests.support.publisher import all_in, rows, running_publisher, settings_for, wait_rows


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[Engine]:
    eng = make_engine(sqlite_url)
    yield eng
    eng.dispose()


@pytest.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    async with FakeBroker() as fake:
        yield fake


def _settings(sqlite_url: str, broker: FakeBroker, **kw: object):  # type: ignore[no-untyped-def]
    return settings_for(db_url=sqlite_url, amqp_url=broker.url, **kw)


async def test_acks_out_of_order(sqlite_url: str, engine: Engine, broker: FakeBroker) -> None:
    ids = add_rows(engine, n=5, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine):
        pubs = await broker.wait_published(5)
        assert [p.message_id for p in pubs] == ids
        assert [p.tag for p in pubs] == [1, 2, 3, 4, 5]
        for index in (2, 0, 4, 1):  # tags 3 1 5 2
            pubs[index].ack()
        await wait_rows(engine, lambda rs: sum(r.status == "confirmed" for r in rs) == 4)
        assert rows(engine)[3].status == "in_flight"
        pubs[3].ack()  # tag 4
        final = await wait_rows(engine, all_in("confirmed"))
    assert all(r.lost_confirms == 0 and r.attempts == 1 for r in final)
    assert len(broker.published) == 5


async def test_multiple_ack_over_gaps(sqlite_url: str, engine: Engine, broker: FakeBroker) -> None:
    """aiormq's test_confirm_multiple shape: acks 1 2 4 5(multiple) settle 1..5."""
    add_rows(engine, n=6, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine):
        pubs = await broker.wait_published(6)
        pubs[0].ack()
        pubs[1].ack()
        pubs[3].ack()
        pubs[4].ack(multiple=True)
        await wait_rows(engine, lambda rs: sum(r.status == "confirmed" for r in rs) == 5)
        assert [r.status for r in rows(engine)] == ["confirmed"] * 5 + ["in_flight"]
        pubs[5].ack()
        await wait_rows(engine, all_in("confirmed"))


async def test_nack_retries_then_confirms(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    add_rows(engine, n=4, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        pubs = await broker.wait_published(4)
        pubs[0].ack()
        pubs[1].nack()
        pubs[3].nack(multiple=True)  # tags 3 and 4
        again = await broker.wait_published(7)
        assert sorted(p.message_id for p in again[4:]) == sorted(p.message_id for p in pubs[1:])
        assert {p.headers["x-outbox-attempt"] for p in again[4:]} == {2}
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed"))
    assert [r.attempts for r in final] == [1, 2, 2, 2]
    assert all(r.lost_confirms == 0 for r in final)
    assert publisher.metrics.nacked == 3


async def test_nack_past_max_attempts_ends_nacked(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    add_rows(engine, n=3, exchange="", max_attempts=2)
    broker.on_publish = lambda pub: pub.nack()
    async with running_publisher(_settings(sqlite_url, broker), engine):
        final = await wait_rows(engine, all_in("nacked"))
    assert all(r.attempts == 2 and r.last_error == "nacked by the broker" for r in final)
    assert len(broker.published) == 6


async def test_return_then_ack(sqlite_url: str, engine: Engine, broker: FakeBroker) -> None:
    add_rows(engine, n=4, exchange="ex")
    async with running_publisher(_settings(sqlite_url, broker), engine):
        pubs = await broker.wait_published(4)
        pubs[1].send_return(312, "NO_ROUTE")
        pubs[2].send_return(313, "NO_CONSUMERS")
        pubs[3].ack(multiple=True)
        final = await wait_rows(engine, all_in("confirmed", "returned"))
    assert [r.status for r in final] == ["confirmed", "returned", "returned", "confirmed"]
    assert (final[1].reply_code, final[1].reply_text) == (312, "NO_ROUTE")
    assert (final[2].reply_code, final[2].reply_text) == (313, "NO_CONSUMERS")
    assert len(broker.published) == 4


async def test_return_then_nack_still_returned(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    add_rows(engine, n=2, exchange="ex")
    async with running_publisher(_settings(sqlite_url, broker), engine):
        pubs = await broker.wait_published(2)
        pubs[0].send_return()
        pubs[1].nack(multiple=True)
        await wait_rows(engine, lambda rs: rs[0].status == "returned")
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed", "returned"))
    assert [r.status for r in final] == ["returned", "confirmed"]


async def test_channel_closed_mid_window(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    """An unexplained close (504) blames the channel's outstanding rows: they go out again as
    suspects, in halves published alone, on a fresh channel whose tags count from 1."""
    add_rows(engine, n=10, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        pubs = await broker.wait_published(10)
        pubs[3].ack(multiple=True)  # 1..4 confirmed
        await wait_rows(engine, lambda rs: sum(r.status == "confirmed" for r in rs) == 4)
        broker.connection.close_channel(pubs[0].channel_id, 504, "CHANNEL_ERROR - test")
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed"))
    republished = broker.published[10:]
    assert {p.channel_id for p in republished} != {pubs[0].channel_id}
    assert [p.tag for p in republished] == [1, 2, 3, 4, 5, 6]  # a fresh channel counts from 1
    assert sorted(p.message_id for p in republished) == sorted(p.message_id for p in pubs[4:])
    assert [r.lost_confirms for r in final] == [0] * 4 + [1] * 6
    assert [r.attempts for r in final] == [1] * 4 + [2] * 6  # each republish is an attempt
    assert {p.headers["x-outbox-attempt"] for p in republished} == {2}
    assert publisher.metrics.channel_closes == 1
    assert publisher.metrics.lost == 6


async def test_a_broker_text_with_nul_settles_on_postgresql(
    pg_url: str, broker: FakeBroker
) -> None:
    """A return and a channel close whose reply texts carry NUL, which PostgreSQL's text
    refuses: the returned row keeps its text readable, the channel's rows are released (their
    confirms lost) and confirm when published again, and so do the rows around them. One such
    text failed the whole write-back it was in, at every retry."""
    engine = make_engine(pg_url)
    try:
        add_rows(engine, n=6, exchange="ex")
        settings = settings_for(db_url=pg_url, amqp_url=broker.url)
        async with running_publisher(settings, engine):
            pubs = await broker.wait_published(6)
            pubs[1].send_return(312, "NO_ROUTE\x00x")
            pubs[2].ack(multiple=True)
            await wait_rows(engine, lambda rs: rs[1].status == "returned")
            broker.connection.close_channel(pubs[3].channel_id, 504, "CHANNEL_ERROR\x00")
            broker.start_auto_ack()
            final = await wait_rows(engine, all_in("confirmed", "returned"))
    finally:
        engine.dispose()
    assert [r.status for r in final] == ["confirmed", "returned"] + ["confirmed"] * 4
    assert final[1].reply_text == "NO_ROUTE\ufffdx"
    assert [r.lost_confirms for r in final[3:]] == [1, 1, 1]


async def test_ack_of_unknown_tag(sqlite_url: str, engine: Engine, broker: FakeBroker) -> None:
    """A broker acking a tag never published is a protocol error: counted, and the channel is
    no longer trusted: its unconfirmed rows go out again on a fresh channel."""
    add_rows(engine, n=4, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        pubs = await broker.wait_published(4)
        pubs[0].ack()
        await wait_rows(engine, lambda rs: rs[0].status == "confirmed")
        broker.connection.ack(pubs[0].channel_id, 99)
        again = await broker.wait_published(7)
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed"))
    assert publisher.metrics.protocol_errors == 1
    assert sorted(p.message_id for p in again[4:]) == sorted(p.message_id for p in pubs[1:])
    assert [r.lost_confirms for r in final] == [0, 1, 1, 1]


async def test_ack_of_settled_tag_is_a_protocol_error(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    add_rows(engine, n=2, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        pubs = await broker.wait_published(2)
        pubs[0].ack()
        pubs[0].ack()
        broker.start_auto_ack()
        await wait_rows(engine, all_in("confirmed"))
    assert publisher.metrics.protocol_errors == 1


async def test_blocked_pauses_without_failing(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    broker.start_auto_ack()
    add_rows(engine, n=3, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        await wait_rows(engine, all_in("confirmed"))
        broker.connection.block("memory alarm")
        await broker.wait_for(lambda: publisher.metrics.blocked)
        add_rows(engine, n=5, exchange="")
        await wait_rows(engine, lambda rs: len(rs) == 8)
        await asyncio.sleep(0.5)
        assert len(broker.published) == 3
        assert all(r.status in ("confirmed", "pending", "in_flight") for r in rows(engine))
        broker.connection.unblock()
        final = await wait_rows(engine, all_in("confirmed"))
    assert len(final) == 8
    assert publisher.metrics.blocked_seconds >= 0.4
    assert publisher.metrics.failed == 0


async def test_oversized_for_broker_fails_only_that_row(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    """The broker's max_message_size is below ours: it closes the channel (406); the big row
    ends failed, the rows in the same window go out again, later big rows fail at once."""
    broker.max_message_size = 1000
    add_rows(engine, n=2, exchange="", prefix="a")
    add_rows(engine, n=1, exchange="", prefix="big", body=b"x" * 2000)
    add_rows(engine, n=2, exchange="", prefix="b")
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        await broker.wait_published(2)
        await broker.wait_for(lambda: publisher.metrics.channel_closes == 1)
        broker.start_auto_ack()
        await wait_rows(engine, all_in("confirmed", "failed"))
        add_rows(engine, n=1, exchange="", prefix="big2", body=b"y" * 1500)
        final = await wait_rows(
            engine, lambda rs: len(rs) == 6 and all_in("confirmed", "failed")(rs)
        )
    assert [r.status for r in final] == ["confirmed"] * 2 + ["failed"] + ["confirmed"] * 2 + [
        "failed"
    ]
    assert "max_message_size (1000 bytes)" in (final[2].last_error or "")
    # later big rows fail before any publish, with the broker's limit as the reason
    assert "max_message_size (1000 bytes)" in (final[5].last_error or "")
    assert publisher.metrics.channel_closes == 1


async def test_connection_dropped_mid_window(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    add_rows(engine, n=6, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        pubs = await broker.wait_published(6)
        pubs[1].ack(multiple=True)
        await wait_rows(engine, lambda rs: sum(r.status == "confirmed" for r in rs) == 2)
        broker.connection.drop()
        await broker.wait_published(10)
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed"))
    assert [r.lost_confirms for r in final] == [0, 0, 1, 1, 1, 1]
    assert publisher.metrics.reconnects == 1


async def test_confirm_timeout_drops_the_connection(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    add_rows(engine, n=3, exchange="")
    settings = _settings(sqlite_url, broker, confirm_timeout=0.5)
    async with running_publisher(settings, engine) as publisher:
        await broker.wait_published(3)
        await broker.wait_connections(2, timeout=10)
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed"))
    assert all(r.lost_confirms >= 1 for r in final)
    assert publisher.metrics.reconnects >= 1


async def test_after_a_confirm_timeout_only_a_few_publishes_wait_for_an_answer(
    sqlite_url: str, engine: Engine, broker: FakeBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker that takes publishes and never answers (a quorum queue without a leader): the
    first connection gets the window, each next one at most CAUTIOUS_WINDOW until an answer
    comes, so the possible duplicates counted stay near what went out the first time; one
    ERROR for the whole stall, and a WARNING when answers come back."""
    from app.publisher.session import CAUTIOUS_WINDOW

    add_rows(engine, n=300, exchange="")
    settings = _settings(sqlite_url, broker, confirm_timeout=0.5)
    async with running_publisher(settings, engine) as publisher:
        await broker.wait_published(300)
        await broker.wait_for(lambda: len(broker.connections) >= 4, timeout=20)
        later = broker.connections[1:4]
        per_connection = [sum(p.connection is c for p in broker.published) for c in later]
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed"), timeout=30)
    assert all(n <= CAUTIOUS_WINDOW for n in per_connection), per_connection
    lost = sum(r.lost_confirms for r in final)
    timeouts = publisher.metrics.confirm_timeouts
    assert timeouts >= 3 and lost <= 300 + CAUTIOUS_WINDOW * (timeouts - 1)
    errors = [r for r in caplog.records if "no confirm for" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelname == "ERROR"
    assert any("answers again after" in r.getMessage() for r in caplog.records)


async def test_missed_heartbeats_drop_the_connection(sqlite_url: str, engine: Engine) -> None:
    async with FakeBroker(heartbeat=1) as broker:
        add_rows(engine, n=2, exchange="")
        settings = _settings(sqlite_url, broker, heartbeat=1)
        async with running_publisher(settings, engine) as publisher:
            await broker.wait_published(2)
            first = broker.connection
            first.silence()
            broker.silent = False
            await broker.wait_for(lambda: first.closed.done(), timeout=6)
            await broker.wait_connections(2)
            broker.start_auto_ack()
            await wait_rows(engine, all_in("confirmed"))
        assert publisher.metrics.reconnects == 1


async def test_missing_exchange_is_checked_not_published(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    broker.missing_exchanges.add("gone")
    broker.start_auto_ack()
    add_rows(engine, n=3, exchange="gone", prefix="g")
    add_rows(engine, n=3, exchange="ok", prefix="o")
    settings = _settings(sqlite_url, broker, destination_retry_budget=2)
    async with running_publisher(settings, engine) as publisher:
        final = await wait_rows(engine, all_in("confirmed", "failed"))
    assert [r.status for r in final] == ["failed"] * 3 + ["confirmed"] * 3
    assert all("NOT_FOUND" in (r.last_error or "") for r in final[:3])
    assert {p.exchange for p in broker.published} == {"ok"}
    assert publisher.metrics.channel_closes == 0


async def test_graceful_stop_releases_the_unconfirmed(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    add_rows(engine, n=4, exchange="")
    settings = _settings(sqlite_url, broker, shutdown_timeout=0.3)
    async with running_publisher(settings, engine) as publisher:
        pubs = await broker.wait_published(4)
        pubs[1].ack(multiple=True)
        await wait_rows(engine, lambda rs: sum(r.status == "confirmed" for r in rs) == 2)
    final = rows(engine)
    assert [r.status for r in final] == ["confirmed", "confirmed", "pending", "pending"]
    assert [r.lost_confirms for r in final] == [0, 0, 1, 1]
    assert publisher.metrics.lost == 2


async def test_unencodable_rows_fail_alone(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    broker.start_auto_ack()
    add_rows(engine, n=2, exchange="", prefix="ok1")
    add_rows(engine, n=1, exchange="bad name!", prefix="badex")
    add_rows(engine, n=1, exchange="", routing_key="é" * 200, prefix="longkey")
    add_rows(engine, n=1, exchange="", prefix="expiry", properties={"expiration": "soon"})
    add_rows(engine, n=2, exchange="", prefix="ok2")
    async with running_publisher(_settings(sqlite_url, broker), engine):
        final = await wait_rows(engine, all_in("confirmed", "failed"))
    assert [r.status for r in final] == ["confirmed"] * 2 + ["failed"] * 3 + ["confirmed"] * 2
    assert all(r.attempts == 1 for r in final)
    assert "expiration" in (final[4].last_error or "")
    assert len(broker.published) == 4


async def test_slow_confirms_show_their_channel_and_tag(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    """Publishes unconfirmed for a while are written with channel and tag while outstanding
    (the API's view of outstanding confirms); every row gets them, with its publish time, in
    the statement that confirms it."""
    add_rows(engine, n=3, exchange="")
    async with running_publisher(_settings(sqlite_url, broker), engine):
        pubs = await broker.wait_published(3)
        pubs[0].ack()
        late = await wait_rows(engine, lambda rs: rs[2].delivery_tag is not None, timeout=5)
        assert [(r.status, r.channel_id, r.delivery_tag) for r in late] == [
            ("confirmed", pubs[0].channel_id, 1),
            ("in_flight", pubs[1].channel_id, 2),
            ("in_flight", pubs[2].channel_id, 3),
        ]
        noted_at = late[2].published_at
        broker.start_auto_ack()
        final = await wait_rows(engine, all_in("confirmed"))
    assert [(r.channel_id, r.delivery_tag) for r in final] == [(p.channel_id, p.tag) for p in pubs]
    for row in final:
        assert row.published_at is not None and row.confirmed_at is not None
        assert row.published_at <= row.confirmed_at
    assert noted_at == final[2].published_at  # the note carries the true publish time


async def test_a_message_that_always_closes_its_channel_ends_failed(
    sqlite_url: str, engine: Engine, broker: FakeBroker
) -> None:
    """A row that closes its channel every time it is published alone ends failed after
    POISON_STRIKES closes, instead of looping forever; each publish is a new attempt."""
    add_rows(engine, n=1, exchange="", max_attempts=3)
    async with running_publisher(_settings(sqlite_url, broker), engine) as publisher:
        for attempt in range(1, 4):
            pubs = await broker.wait_published(attempt)
            broker.connection.close_channel(pubs[-1].channel_id, 504, "CHANNEL_ERROR - poison")
        final = await wait_rows(engine, all_in("failed"), timeout=10)
    assert (final[0].attempts, final[0].lost_confirms) == (3, 2)
    assert "closed its channel or connection alone 3 times" in (final[0].last_error or "")
    assert "CHANNEL_ERROR - poison" in (final[0].last_error or "")
    assert len(broker.published) == 3 and publisher.metrics.channel_closes == 3
    assert publisher.metrics.poison == 1 and publisher.metrics.failed == 1
