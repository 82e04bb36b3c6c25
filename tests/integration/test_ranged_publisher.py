"""The publisher settling by ranges (``OUTBOX_SETTLEMENT=ranges``) against the real RabbitMQ and
PostgreSQL: every message once, no plain row ever rewritten on the happy path (its ``xmin`` is
still its INSERT's), exceptions written on their rows alone, a dead publisher's ranges handed
back and published again, and the row path's rows (keys, delays, rows from before 0023) beside
them."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import generate_latest
from sqlalchemy import Engine, text

from app.db import SchemaMismatch, make_engine
from app.outbox.ranged import RangedPublisherStore
from app.outbox.ranges import RangeStore
from app.publisher.engine import Publisher
from app.publisher.metrics import PublisherStats, registry_for
from app.publisher.service import settling_store
from tests.support.factories import add_rows
from tests.support.publisher import consume_ids, declare, delete, settings_for

#: Plain rows whose row was never written after its INSERT: the row version's ``xmin`` is the
#: writing transaction's (``xid`` keeps its 64-bit form).
REWRITTEN = (
    "SELECT count(*) FROM outbox WHERE xid IS NOT NULL AND ordering_key IS NULL "
    "AND stream IS NULL AND not_before IS NULL AND NOT row_path "
    "AND xmin::text::bigint <> xid::text::bigint % 4294967296"
)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    eng = make_engine(pg_url)
    yield eng
    eng.dispose()


@pytest.fixture
async def topology(amqp_url: str) -> AsyncIterator[dict[str, str]]:
    names = {"exchange": f"test-rng-ex-{uuid.uuid4().hex[:8]}"}
    names["queue"] = names["exchange"].replace("-ex-", "-q-")
    await declare(amqp_url, exchange=names["exchange"], queue=names["queue"])
    yield names
    await delete(amqp_url, exchanges=(names["exchange"],), queues=(names["queue"],))


async def _drain(pg_url: str, amqp_url: str, engine: Engine, **overrides: object) -> PublisherStats:
    stats, _ = await _drain_with(pg_url, amqp_url, engine, **overrides)
    return stats


async def _drain_with(
    pg_url: str, amqp_url: str, engine: Engine, **overrides: object
) -> tuple[PublisherStats, dict[str, float]]:
    """Run a publisher settling by ranges until the outbox is drained; its stats and its
    ``outbox_publisher_range_*`` counters as /metrics shows them."""
    settings = settings_for(db_url=pg_url, amqp_url=amqp_url, settlement="ranges", **overrides)
    publisher = Publisher(settings=settings, store=RangedPublisherStore(engine))
    async with asyncio.timeout(120):
        stats = await publisher.run(until_empty=True)
    scraped = generate_latest(registry_for(publisher.metrics, publisher_id="p")).decode()
    found = re.findall(
        r'^outbox_publisher_range_(\w+)_total\{publisher="p"\} (\S+)$', scraped, re.M
    )
    return stats, {name: float(value) for name, value in found}


def _derived(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        ids = dict(conn.execute(text("SELECT id, message_id FROM outbox")).all())
    return {ids[i]: s for i, s in RangeStore(engine).statuses(list(ids)).items()}


def _scalar(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


async def test_ranges_publish_each_message_once_and_rewrite_no_plain_row(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    ex = topology["exchange"]
    plain = add_rows(pg_engine, n=3000, exchange=ex, routing_key="rk")
    keyed = add_rows(pg_engine, n=30, exchange=ex, routing_key="rk", ordering_key="k-1")
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.5)
    delayed = add_rows(
        pg_engine, n=10, exchange=ex, routing_key="rk", not_before=soon, available_at=soon
    )
    with pg_engine.begin() as conn:  # rows from before 0023: no xid, the row path's
        conn.execute(text("ALTER TABLE outbox ALTER COLUMN xid DROP DEFAULT"))
    old = add_rows(pg_engine, n=20, exchange=ex, routing_key="rk")
    with pg_engine.begin() as conn:
        conn.execute(text("ALTER TABLE outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id()"))
    stats = await _drain(pg_url, amqp_url, pg_engine, claim_batch=200, window=1000)
    everything = [*plain, *keyed, *delayed, *old]
    seen = await consume_ids(amqp_url, topology["queue"], expect=len(everything))
    assert seen == {m: 1 for m in everything}, "every message once"
    assert stats.confirmed == len(everything)
    assert set(_derived(pg_engine).values()) == {"confirmed"}
    assert _scalar(pg_engine, REWRITTEN) == 0, "a plain row was rewritten"
    assert _scalar(pg_engine, "SELECT count(*) FROM outbox WHERE status = 'confirmed'") == 60
    ranges = _scalar(pg_engine, "SELECT count(*) FROM outbox_ranges WHERE settled_at IS NULL")
    assert ranges == 0, "every range settled"


async def test_an_exception_is_written_on_its_row_alone(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    ex = topology["exchange"]
    good = add_rows(pg_engine, n=400, exchange=ex, routing_key="rk")
    lost = add_rows(pg_engine, n=7, exchange=ex, routing_key="nowhere")  # mandatory: returned
    more = add_rows(pg_engine, n=400, exchange=ex, routing_key="rk")
    stats, ranges = await _drain_with(pg_url, amqp_url, pg_engine, claim_batch=100)
    assert ranges["adopted"] == 7, ranges
    derived = _derived(pg_engine)
    assert {derived[m] for m in [*good, *more]} == {"confirmed"}
    assert {derived[m] for m in lost} == {"returned"}
    assert stats.returned == 7
    with pg_engine.connect() as conn:
        written = dict(
            conn.execute(text("SELECT message_id, status FROM outbox WHERE row_path")).all()
        )
    assert written == dict.fromkeys(lost, "returned"), "only the exceptions are on the row path"
    assert _scalar(pg_engine, REWRITTEN) == 0


async def test_a_dead_publishers_ranges_are_published_again_and_counted(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    ids = add_rows(pg_engine, n=500, exchange=topology["exchange"], routing_key="rk")
    dead = RangedPublisherStore(pg_engine)
    taken = dead.claim(owner="dead-publisher", limit=200, lease_seconds=0.5)
    assert len(taken) == 200 and dead.held_ranges()
    await asyncio.sleep(0.6)  # its lease runs out; the live publisher's sweep hands them back
    stats, ranges = await _drain_with(pg_url, amqp_url, pg_engine, lease_seconds=2.0)
    seen = await consume_ids(amqp_url, topology["queue"], expect=len(ids))
    assert ranges["expired_rows"] == 200 and ranges["expired"] >= 1, ranges
    # the 200 handed back went out on the row path; the rest as its own ranges' members
    assert ranges["members"] == 300 and ranges["settled"] == ranges["claimed"], ranges
    assert seen == {m: 1 for m in ids}, "the dead one never published: once each"
    assert set(_derived(pg_engine).values()) == {"confirmed"}
    lost = _scalar(pg_engine, "SELECT count(*) FROM outbox WHERE lost_confirms = 1")
    assert lost == 200, "each row of the dead publisher's ranges is a possible duplicate"
    assert stats.lost >= 200, "counted by the publisher that handed them back"


def test_settling_rows_on_a_ranged_outbox_is_refused(pg_url: str, pg_engine: Engine) -> None:
    add_rows(pg_engine, n=3)
    settings = settings_for(db_url=pg_url, amqp_url="amqp://guest:guest@127.0.0.1:1/")
    assert type(settling_store(pg_engine, settings)).__name__ == "PublisherStore"
    RangeStore(pg_engine).claim(owner="p", limit=3, lease_seconds=30)
    with pytest.raises(SchemaMismatch, match="OUTBOX_SETTLEMENT=ranges"):
        settling_store(pg_engine, settings)
    ranged = settings_for(db_url=pg_url, amqp_url=settings.amqp_url.get_secret_value())
    ranged = ranged.model_copy(update={"settlement": "ranges"})
    assert isinstance(settling_store(pg_engine, ranged), RangedPublisherStore)


async def test_a_database_outage_mid_drain_counts_no_settled_member_again(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """Sessions ended under the publisher while ranges are being settled: the check after the
    outage never takes a range's member for a row whose confirm a crash undid (its status on
    the row is not its status), so nothing is counted or written on them."""
    ids = add_rows(pg_engine, n=4000, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(
        db_url=pg_url, amqp_url=amqp_url, settlement="ranges", claim_batch=100, window=400
    )
    own = make_engine(pg_url)
    publisher = Publisher(settings=settings, store=RangedPublisherStore(own))
    task = asyncio.create_task(publisher.run(until_empty=True))
    try:
        for _ in range(3):
            await asyncio.sleep(0.3)
            with pg_engine.connect() as conn:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                        "datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
        async with asyncio.timeout(120):
            stats = await task
    finally:
        task.cancel()
        own.dispose()
    assert stats.confirmed >= len(ids)
    seen = await consume_ids(amqp_url, topology["queue"], expect=len(ids))
    assert set(seen) == set(ids)
    assert set(_derived(pg_engine).values()) == {"confirmed"}
    again = _scalar(pg_engine, "SELECT coalesce(sum(lost_confirms), 0) FROM outbox")
    assert again == sum(n - 1 for n in seen.values()), "each copy counted, nothing else"
    assert _scalar(pg_engine, REWRITTEN) == 0


def test_a_settle_retried_after_its_reply_was_lost_finds_its_own(pg_engine: Engine) -> None:
    """A write-back whose COMMIT went through but whose reply was lost runs again: its settle
    finds the range settled by its own owner (not lost, so no row counted), while a range
    ``expire`` closed is no one's to settle."""
    add_rows(pg_engine, n=6)
    store = RangeStore(pg_engine)
    (mine,) = store.claim(owner="p", limit=3, lease_seconds=30)
    (gone,) = store.claim(owner="p", limit=3, lease_seconds=30)
    assert store.settle_ids(owner="p", range_ids=[mine.range_id]) == [mine.range_id]
    assert store.settle_ids(owner="p", range_ids=[mine.range_id]) == [mine.range_id]
    assert store.settle_ids(owner="q", range_ids=[mine.range_id]) == []
    assert store.orphans(owner="p", keep=[], known=[gone.range_id]) == (1, 0, 3)
    assert store.settle_ids(owner="p", range_ids=[gone.range_id]) == []


def test_orphaned_ranges_go_back_counted_only_if_they_were_seen(pg_engine: Engine) -> None:
    """The check after an outage: a range leased to us that we never saw (its claim's reply
    was lost) goes back as it was; one we had seen (its settle undone) counts each member as a
    possible duplicate; one we hold is left alone."""
    ids = add_rows(pg_engine, n=9)
    store = RangeStore(pg_engine)
    unseen, seen, held = (store.claim(owner="p", limit=3, lease_seconds=30)[0] for _ in range(3))
    got = store.orphans(owner="p", keep=[held.range_id], known=[seen.range_id, held.range_id])
    assert got == (2, 3, 3)
    with pg_engine.connect() as conn:
        lost = dict(conn.execute(text("SELECT message_id, lost_confirms FROM outbox")).all())
    by_range = {c.range_id: {r.message_id for r in c.rows} for c in (unseen, seen, held)}
    assert {m for m in ids if lost[m]} == by_range[seen.range_id]
    statuses = _derived(pg_engine)
    assert {statuses[m] for m in by_range[unseen.range_id] | by_range[seen.range_id]} == {"pending"}
    assert {statuses[m] for m in by_range[held.range_id]} == {"in_flight"}
