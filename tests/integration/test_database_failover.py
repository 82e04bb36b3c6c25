"""The outbox's PostgreSQL with a streaming standby (issue 49): every component finds the primary
through a multi-host URL, follows a switchover, and the writers learn how far the standby has
their commits, so that a failover that undoes some is counted (publisher) or never reaches
Spark's checkpoint (Spark writer).

A primary and a standby of this module's own (tests/support/pgpair.py: ``initdb`` and
``pg_basebackup``, no Patroni; the fault matrix's scenarios 19 run Patroni). The multi-host URLs
list the standby first: the primary is found by ``target_session_attrs=read-write``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text

from app.api.app import create_app
from app.consumer import ConsumerConfig
from app.consumer.kit import consumer_engine
from app.db import make_engine, migrate
from app.outbox.database import OutboxDatabase
from app.outbox.enqueue import Message, enqueue
from app.outbox.store import PublisherStore
from app.publisher import listener
from app.publisher.engine import Publisher
from spark_writer.db import open_store
from spark_writer.dburl import pg_conninfo
from spark_writer.envelope import BatchRef
from spark_writer.errors import OutboxReplicationError
from spark_writer.options import OutboxOptions
from spark_writer.writer import on_standbys
from tests.support import pgpair
from tests.support.api import R, client_for
from tests.support.api import settings_for as api_settings
from tests.support.consumer import (
    create_effects,
    declared_queue,
    effects,
    publish,
    record,
    running_consumer,
    until,
)
from tests.support.factories import add_rows
from tests.support.publisher import consume_ids, rows, settings_for

pytestmark = pytest.mark.skipif(pgpair.missing() is not None, reason=str(pgpair.missing()))


@pytest.fixture(scope="module")
def pair() -> Iterator[pgpair.PgPair]:
    pg = pgpair.PgPair()
    try:
        pg.start()
        migrate(pg.url())  # alembic, through the multi-host URL
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def engine(pair: pgpair.PgPair) -> Iterator[Engine]:
    eng = make_engine(pair.url())
    with eng.begin() as conn:  # each test starts on an empty outbox
        conn.execute(text("TRUNCATE outbox, outbox_events RESTART IDENTITY"))
    yield eng
    eng.dispose()


def _on_primary(engine: Engine) -> bool:
    with engine.connect() as conn:
        return conn.execute(text("SELECT NOT pg_is_in_recovery()")).scalar_one() is True


# ---------------------------------------------------------------- every component finds it


def test_the_engine_the_enqueue_api_and_the_listener_find_the_primary(
    pair: pgpair.PgPair, engine: Engine
) -> None:
    assert _on_primary(engine)
    with engine.begin() as conn:
        done = enqueue(conn, [Message(exchange="ex", routing_key="rk", body=b"{}")])
    assert len(done.inserted) == 1
    conninfo = listener.libpq_conninfo(pair.url())
    assert conninfo is not None
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    assert row is not None and row[0] is False


def test_the_spark_writer_reads_the_multi_host_url_as_libpq_does(pair: pgpair.PgPair) -> None:
    """Passed through as a URI, libpq kept only the last ``host=`` and read
    ``127.0.0.1:<port>`` as a host name; now the hosts and ports are libpq's lists."""
    conninfo = pg_conninfo(pair.url())
    assert f"port={pair.standby_port},{pair.primary_port}" in conninfo
    assert "host=127.0.0.1,127.0.0.1" in conninfo and "target_session_attrs=read-write" in conninfo
    with open_store(pair.url()) as store:
        row = store.conn.execute("SELECT pg_is_in_recovery()").fetchone()
    assert row is not None and row[0] is False


async def test_the_api_reads_and_writes_on_the_primary(pair: pgpair.PgPair, engine: Engine) -> None:
    add_rows(engine, n=3)
    app = create_app(api_settings(pair.url()))
    async with client_for(app) as client:
        stats = await client.get("/v1/stats", headers=R)
    assert stats.status_code == 200, stats.text
    assert stats.json()["counts"]["pending"] == 3, stats.json()


async def test_the_consumer_kit_keeps_its_inbox_on_the_primary(
    pair: pgpair.PgPair, amqp_url: str
) -> None:
    engine = consumer_engine(pair.url(), concurrency=2)
    try:
        create_effects(engine)
        async with declared_queue(amqp_url, prefix="failover-kit") as queue:
            await publish(amqp_url, queue, ["kit-1", "kit-2"])
            config = ConsumerConfig(name="failover", queue=queue, concurrency=2)
            async with running_consumer(amqp_url, engine, config, handler=record):
                await until(lambda: len(effects(engine)) == 2, what="two effects")
        assert sorted(effects(engine)) == ["kit-1", "kit-2"]
    finally:
        engine.dispose()


# ---------------------------------------------------------------- how far the standby is


def test_write_backs_read_how_far_the_standby_has_the_wal(
    pair: pgpair.PgPair, engine: Engine
) -> None:
    db = OutboxDatabase(engine)
    pair.caught_up()
    with db.unit_of_work(positions=True):
        pass
    first = db.wal_positions()
    assert first is not None and first.standbys is not None and first.standbys >= 0
    pair.freeze_receiver()
    try:
        add_rows(engine, n=500)
        with db.unit_of_work(positions=True):
            pass
        behind = db.wal_positions()
        assert behind is not None and behind.standbys is not None
        assert behind.durable is not None and behind.durable < behind.end  # the standby lacks it
    finally:
        pair.thaw_receiver()
    pair.caught_up()
    with db.unit_of_work(positions=True):
        pass
    after = db.wal_positions()
    assert after is not None and after.durable is not None and after.durable >= behind.end


def test_a_role_that_may_not_read_the_standby_says_so(pair: pgpair.PgPair) -> None:
    plain = make_engine(pair.url(user=pgpair.PLAIN_ROLE))
    try:
        db = OutboxDatabase(plain)
        with db.unit_of_work(positions=True):
            pass
        wal = db.wal_positions()
    finally:
        plain.dispose()
    assert wal is not None and wal.standbys == -1 and wal.durable is None


async def test_the_publisher_remembers_every_write_back_the_standby_lacks(
    pair: pgpair.PgPair, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """With the standby's WAL receiver stopped, no write-back is durable on the standby: the
    publisher forgets none of them (a failover now would undo them all, and it would count
    every row it then finds set back). On a healthy pair it forgets most (test_publisher_broker:
    test_write_backs_are_forgotten_once_postgres_says_they_are_on_disk)."""
    add_rows(engine, n=1000, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(db_url=pair.url(), amqp_url=amqp_url, claim_batch=100, window=300)
    publisher = Publisher(settings=settings, store=PublisherStore(engine))
    pair.freeze_receiver()
    try:
        async with asyncio.timeout(120):
            stats = await publisher.run(until_empty=True)
    finally:
        pair.thaw_receiver()
    assert stats.confirmed == 1000
    kept = list(publisher.writeback._undoable)
    assert len(kept) == publisher.metrics.flushes >= 3
    assert sum(len(e.published) + len(e.bare) for e in kept) == 1000
    await consume_ids(amqp_url, topology["queue"], expect=1000)


def test_a_recorded_spark_batch_waits_until_the_standby_has_it(
    pair: pgpair.PgPair, caplog: pytest.LogCaptureFixture
) -> None:
    """Spark marks a batch done in its checkpoint once the sink returns; an asynchronous standby
    that lacks the batch's commits would lose it in a failover for good. So the writer returns
    only once the standby has them, and fails the batch (Spark runs it again) past
    ``standby_wait``."""
    options = OutboxOptions(url=pair.url(), sink="failover", exchange="ex", routing_key="rk")
    short = OutboxOptions(
        url=pair.url(), sink="failover", exchange="ex", routing_key="rk", standby_wait=0.5
    )
    batch = BatchRef(sink="failover", spark_batch_id=1, query_id="q")
    pair.caught_up()
    with open_store(pair.url()) as store:
        on_standbys(store, options, batch)  # caught up: returns at once
        pair.freeze_receiver()
        try:
            store.conn.execute("INSERT INTO outbox_held (batch_id) VALUES ('failover:x')")
            with caplog.at_level(logging.ERROR), pytest.raises(OutboxReplicationError) as err:
                on_standbys(store, short, batch)
        finally:
            pair.thaw_receiver()
        assert err.value.behind > 0 and "bytes of WAL short" in str(err.value)
        on_standbys(store, options, batch)  # the standby catches up within the wait
        store.conn.execute("DELETE FROM outbox_held WHERE batch_id = 'failover:x'")


# ---------------------------------------------------------------- a switchover


async def test_the_publisher_follows_a_switchover_mid_drain(
    amqp_url: str, topology: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A pair of its own (the switchover ends it): the publisher drains through a multi-host
    URL whose first host is the primary; mid-drain the primary stops and the standby is
    promoted. The publisher goes on on the new primary by itself: every row confirmed, every
    duplicate counted, the outage logged once (a WARNING) and its end with its length (an
    INFO), and LISTEN listening on the new primary."""
    pg = pgpair.PgPair()
    try:
        pg.start()
        url = pg.url(order=("primary", "standby"))
        migrate(url)
        engine = make_engine(url)
        ids = add_rows(engine, n=3000, exchange=topology["exchange"], routing_key="rk")
        settings = settings_for(db_url=url, amqp_url=amqp_url, claim_batch=100, window=300)
        publisher = Publisher(settings=settings, store=PublisherStore(engine))
        api = create_app(api_settings(url))  # its pool's connections die with the old primary
        async with client_for(api) as client:
            assert (await client.get("/v1/stats", headers=R)).status_code == 200
        with caplog.at_level(logging.INFO, logger="app.publisher"):
            task = asyncio.create_task(publisher.run(until_empty=True))
            async with asyncio.timeout(60):
                while publisher.metrics.confirmed < 600:
                    await asyncio.sleep(0.01)
            await asyncio.to_thread(pg.switchover)
            async with asyncio.timeout(120):
                stats = await task
        assert _on_primary(engine)
        async with client_for(api) as client:  # no restart: the next request finds the primary
            after = await client.get("/v1/stats", headers=R)
        assert after.status_code == 200 and after.json()["counts"]["confirmed"] == 3000
        final = rows(engine)
        engine.dispose()
    finally:
        pg.stop()
    assert all(r.status == "confirmed" for r in final) and len(final) == 3000
    counted = sum(r.lost_confirms for r in final)
    seen = await consume_ids(amqp_url, topology["queue"], expect=3000)
    assert set(seen) == set(ids)
    assert sum(seen.values()) - len(seen) <= counted
    records = [r for r in caplog.records if r.name == "app.publisher"]
    began = [r for r in records if "a database call failed" in r.getMessage()]
    ended = [r for r in records if "the database answers again after" in r.getMessage()]
    assert [r.levelname for r in began] == ["WARNING"] and [r.levelname for r in ended] == ["INFO"]
    assert not [r for r in records if r.exc_info and r.levelno >= logging.ERROR]
    assert stats.confirmed >= 3000
