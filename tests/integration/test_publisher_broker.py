"""The publisher against the real RabbitMQ: drains, real nacks, returns, missing and forbidden
exchanges, oversized bodies, a cut connection, several publishers on one PostgreSQL outbox."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import logging
import re
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from sqlalchemy import Connection, Engine, event, insert, make_url, select, update
from sqlalchemy import delete as delete_rows
from sqlalchemy.exc import DBAPIError, OperationalError

from app.db import make_engine
from app.outbox.database import OutboxDatabase
from app.outbox.records import ClaimedRow
from app.outbox.schema import outbox, publishers
from app.outbox.store import PublisherStore
from app.publisher import unreachable
from app.publisher.engine import Publisher
from app.publisher.metrics import registry_for
from chaos.proxy import TcpProxy
from tests.support.env import services_env
from tests.support.factories import add_rows
from tests.support.publisher import (
    all_in,
    consume_ids,
    declare,
    delete,
    rows,
    run_until_empty,
    running_publisher,
    settings_for,
    wait_rows,
)

SERVICES = Path(__file__).resolve().parents[2] / "deploy" / "local" / "services.sh"


def _name(kind: str) -> str:
    return f"test-pub-{kind}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    eng = make_engine(pg_url)
    yield eng
    eng.dispose()


@pytest.fixture
async def topology(amqp_url: str) -> AsyncIterator[dict[str, str]]:
    """A direct exchange bound to a durable queue with routing key ``rk``; deleted afterwards."""
    names = {"exchange": _name("ex"), "queue": _name("q")}
    await declare(amqp_url, exchange=names["exchange"], queue=names["queue"])
    yield names
    await delete(amqp_url, exchanges=(names["exchange"],), queues=(names["queue"],))


async def test_drain_10k_each_message_exactly_once(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    ids = add_rows(engine, n=10_000, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(db_url=db_url, amqp_url=amqp_url, window=2000)
    stats = await run_until_empty(settings, engine)
    final = rows(engine)
    assert all(r.status == "confirmed" and r.attempts == 1 for r in final)
    assert stats.confirmed == stats.published == 10_000
    with engine.connect() as conn:
        registry = conn.execute(select(publishers.c.stats, publishers.c.stopped_at)).one()
    assert registry.stopped_at is not None
    assert registry.stats["confirmed"] == 10_000 and registry.stats["lost_confirms"] == 0
    seen = await consume_ids(amqp_url, topology["queue"], expect=10_000)
    assert set(seen) == set(ids)
    assert set(seen.values()) == {1}


async def test_drain_writes_publish_facts_with_every_confirm(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """Every confirmed row carries the channel and delivery tag it was confirmed under and the
    time it was published (the stats' confirm latencies come from these)."""
    add_rows(engine, n=3000, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(db_url=db_url, amqp_url=amqp_url, channels=2, claim_batch=250)
    stats = await run_until_empty(settings, engine)
    final = rows(engine)
    assert stats.confirmed == 3000 and all(r.status == "confirmed" for r in final)
    for row in final:
        assert row.channel_id is not None and row.delivery_tag is not None, row
        assert row.published_at is not None and row.confirmed_at is not None, row
        assert row.published_at <= row.confirmed_at, row
    per_channel = collections.Counter((r.channel_id, r.delivery_tag) for r in final)
    assert set(per_channel.values()) == {1}  # each (channel, tag) names one publish
    await consume_ids(amqp_url, topology["queue"], expect=3000)


class _FailsOnce(PublisherStore):
    """The real repository, except that the first flush dies after its confirm statement ran."""

    failed = False

    def mark_confirmed(self, **kwargs: Any) -> int:
        moved = super().mark_confirmed(**kwargs)
        if not self.failed and moved:
            self.failed = True
            raise RuntimeError("injected failure after the confirm statement")
        return moved


async def test_failed_flush_rolls_back_and_is_retried_whole(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """A flush is one transaction: the confirm statement that ran before the failure is rolled
    back, and the retried flush moves every row itself (a partial commit would show up as rows
    'no longer held', i.e. lease_lost)."""
    add_rows(engine, n=500, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(db_url=db_url, amqp_url=amqp_url)
    repo = _FailsOnce(engine)
    publisher = Publisher(settings=settings, store=repo)
    async with asyncio.timeout(120):
        stats = await publisher.run(until_empty=True)
    assert repo.failed and publisher.metrics.db_errors == 1
    assert publisher.metrics.lease_lost == 0
    assert stats.confirmed == 500
    final = rows(engine)
    assert all(r.status == "confirmed" and r.published_at is not None for r in final)
    await consume_ids(amqp_url, topology["queue"], expect=500)


class _ClaimUndone(PublisherStore):
    """The real repository, except that its first confirm write-back finds every other row put
    back to pending with no owner, as a failover to a standby that had not received the claim
    leaves them (issue 49), or a sweep of a lease that ran out while the publisher was paused."""

    undone: list[int] = []

    def mark_confirmed(self, **kwargs: Any) -> int:
        if not self.undone:
            ids = sorted([p.id for p in kwargs.get("published", ())] + list(kwargs.get("ids", ())))
            self.undone = ids[::2]
            with self.db.begin() as conn:  # the write-back's own transaction
                conn.execute(
                    update(outbox)
                    .where(outbox.c.id.in_(self.undone))
                    .values(status="pending", lease_owner=None, lease_until=None)
                )
        return super().mark_confirmed(**kwargs)


async def test_confirms_of_rows_no_longer_held_count_as_possible_duplicates(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """Issue 49: after a failover whose standby lacked the claim, the broker's confirms of the
    rows were refused by the database (lease lost) and the rows published again, with
    ``lost_confirms`` 0. Now each such row is a counted possible duplicate, and the count equals
    the duplicates the queue received."""
    add_rows(engine, n=200, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(db_url=db_url, amqp_url=amqp_url)
    repo = _ClaimUndone(engine)
    publisher = Publisher(settings=settings, store=repo)
    async with asyncio.timeout(120):
        stats = await publisher.run(until_empty=True)
    assert repo.undone and publisher.metrics.lease_lost >= len(repo.undone)
    assert stats.lost == len(repo.undone)
    final = rows(engine)
    assert all(r.status == "confirmed" for r in final)
    assert {r.id for r in final if r.lost_confirms == 1} == set(repo.undone)  # on the rows too
    assert all(r.lost_confirms <= 1 for r in final)
    seen = await consume_ids(amqp_url, topology["queue"], expect=200 + len(repo.undone))
    assert sum(seen.values()) - len(seen) == len(repo.undone) == stats.lost


class _IdleSessionEnded(Exception):
    sqlstate = "25P03"  # idle_in_transaction_session_timeout, as psycopg reports it


class _ClaimSessionEnded(PublisherStore):
    """The real repository, except that its first claim finds its session ended by the server
    for sitting idle past the claim's bound (the real server's end is tested in
    test_frozen_publisher.py; this checks what the publisher makes of it)."""

    ended = False

    def claim_once(self, **kwargs: Any) -> list[ClaimedRow]:
        if not self.ended:
            self.ended = True
            raise DBAPIError("claim", {}, _IdleSessionEnded("terminating connection"))
        return super().claim_once(**kwargs)


async def test_a_claim_run_again_after_its_session_ended_is_counted(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """The claim's retry (last session's fix) was only logged: it now counts in
    ``claims_retried``, in the publisher's report and on its ``/metrics``."""
    add_rows(engine, n=20, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(db_url=db_url, amqp_url=amqp_url)
    repo = _ClaimSessionEnded(engine)
    publisher = Publisher(settings=settings, store=repo)
    async with asyncio.timeout(60):
        stats = await publisher.run(until_empty=True)
    assert repo.ended and stats.confirmed == 20 and publisher.metrics.db_errors == 0
    assert publisher.metrics.claims_retried == 1 and publisher.report().claims_retried == 1
    exposed = generate_latest(registry_for(publisher.metrics, publisher_id="p")).decode()
    assert 'outbox_publisher_claims_retried_total{publisher="p"} 1.0' in exposed


class _ClaimReplyLost(PublisherStore):
    """The real repository, except that the second claim commits and then raises, as when the
    COMMIT's reply is lost on the network (chaos scenario 11c)."""

    claims = 0
    lost: list[int] = []

    def claim(self, **kwargs: Any) -> list[ClaimedRow]:
        rows = super().claim(**kwargs)
        self.claims += 1
        if self.claims == 2:
            self.lost = [r.id for r in rows]
            raise OperationalError("COMMIT", {}, Exception("connection reset"))
        return rows


async def test_rows_of_a_claim_whose_result_was_lost_are_released(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """Rows the DB leased to us in a claim we saw fail are found and released (not renewed by
    the heartbeat forever): the drain finishes, well inside the lease, each message once."""
    ids = add_rows(engine, n=300, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(
        db_url=db_url, amqp_url=amqp_url, claim_batch=100, window=300, lease_seconds=60.0
    )
    repo = _ClaimReplyLost(engine)
    publisher = Publisher(settings=settings, store=repo)
    async with asyncio.timeout(30):  # the lease is 60 s: expiry cannot be what frees them
        stats = await publisher.run(until_empty=True)
    assert len(repo.lost) == 100 and stats.confirmed == 300
    final = rows(engine)
    assert all(r.status == "confirmed" for r in final)
    assert all(r.lost_confirms == 0 for r in final)  # never published before: not a duplicate
    orphans = [r for r in final if r.id in set(repo.lost)]
    assert all(r.attempts == 2 for r in orphans)
    seen = await consume_ids(amqp_url, topology["queue"], expect=300)
    assert set(seen) == set(ids) and set(seen.values()) == {1}


class _CrashUndoesAWriteback(OutboxDatabase):
    """The real database, except that a database crash is acted out around the first
    write-back that confirms rows: its commit (one that did not wait for the disk) is undone,
    so those rows are ``in_flight`` under our lease again, as the claim left them; then the
    publisher's next database call fails, whichever it is (of the store or the registry), as
    the first call on a connection to a crashed server does. Chaos scenario 11d crashes a real
    PostgreSQL, but cannot make a crash land on such a commit."""

    undone: list[int] = []
    failed = False
    owner = ""
    #: a failover to a standby that had neither the write-back nor the claim before it: the
    #: rows are back to ``pending``, nobody's, one attempt fewer
    claim_lost = False
    #: ... nor the rows' insert: they are gone
    insert_lost = False

    def _crashed(self) -> None:
        if self.undone and not self.failed:
            self.failed = True
            raise OperationalError("BEGIN", {}, Exception("server closed the connection"))

    @contextlib.contextmanager
    def unit_of_work(
        self, *, durable: bool = True, by_id: bool = False, positions: bool = False
    ) -> Iterator[None]:
        self._crashed()
        before = set(self.confirmed_ids())
        with super().unit_of_work(durable=durable, by_id=by_id, positions=positions):
            yield
        if positions and not self.undone:  # the write-back's unit
            self.undone = sorted(set(self.confirmed_ids()) - before)
            if self.insert_lost:
                with self.engine.begin() as conn:
                    conn.execute(delete_rows(outbox).where(outbox.c.id.in_(self.undone)))
                return
            if self.claim_lost:
                values: dict[str, Any] = {
                    "status": "pending",
                    "lease_owner": None,
                    "lease_until": None,
                    "published_at": None,
                    "attempts": outbox.c.attempts - 1,
                }
            else:
                values = {
                    "status": "in_flight",
                    "lease_owner": self.owner,
                    "lease_until": self.clock() + dt.timedelta(seconds=60),
                }
            with self.engine.begin() as conn:
                conn.execute(
                    update(outbox)
                    .where(outbox.c.id.in_(self.undone))
                    .values(confirmed_at=None, **values)
                )

    @contextlib.contextmanager
    def begin(self, *, by_id: bool = False) -> Iterator[Connection]:
        if getattr(self._local, "conn", None) is None:  # a call of its own, not in a unit
            self._crashed()
        with super().begin(by_id=by_id) as conn:
            yield conn

    def confirmed_ids(self) -> list[int]:
        with self.engine.connect() as conn:
            return list(
                conn.execute(select(outbox.c.id).where(outbox.c.status == "confirmed")).scalars()
            )


async def test_write_back_undone_by_a_database_crash_is_written_again(
    db_url: str, amqp_url: str, topology: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Write-backs commit without waiting for the disk (``synchronous_commit`` off, the
    default). A crash that undoes one leaves rows we confirmed in flight under our lease; after
    any failed database call the publisher finds them and, holding their publish facts, writes
    their confirms again: nothing stranded, nothing published twice (docs/guarantees.md). Until
    issue 49 they were released and published again, each a counted duplicate."""
    engine = make_engine(db_url)
    try:
        ids = add_rows(engine, n=300, exchange=topology["exchange"], routing_key="rk")
        settings = settings_for(
            db_url=db_url, amqp_url=amqp_url, claim_batch=100, window=300, lease_seconds=60.0
        )
        repo = _CrashUndoesAWriteback(engine)
        publisher = Publisher(settings=settings, store=PublisherStore(repo))
        repo.owner = publisher.publisher_id
        async with asyncio.timeout(30):  # the lease is 60 s: expiry cannot be what frees them
            stats = await publisher.run(until_empty=True)
        final = rows(engine)
    finally:
        engine.dispose()
    undone = set(repo.undone)
    assert undone and repo.failed
    assert stats.confirmed == 300
    assert all(r.status == "confirmed" and r.published_at is not None for r in final)
    assert all(r.lost_confirms == 0 for r in final)
    assert f"{len(undone)} rows we had confirmed were set back" in caplog.text
    assert publisher.metrics.confirms_rewritten == len(undone)
    assert publisher.metrics.lost_confirms == 0
    seen = await consume_ids(amqp_url, topology["queue"], expect=300)
    assert set(seen) == set(ids) and set(seen.values()) == {1}


async def test_write_back_and_claim_undone_by_a_failover_are_written_again(
    db_url: str, amqp_url: str, topology: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 49: a failover to a standby behind the primary undoes the write-back that
    confirmed rows and the claim before it: the rows are ``pending`` again, nobody's, and the
    next claim published them again. A trial counted none of 8,000 such duplicates. Now the
    check after the outage, before the next claim, writes their confirms again (the publisher
    kept their publish facts): none goes out twice."""
    engine = make_engine(db_url)
    try:
        ids = add_rows(engine, n=300, exchange=topology["exchange"], routing_key="rk")
        settings = settings_for(
            db_url=db_url, amqp_url=amqp_url, claim_batch=100, window=300, lease_seconds=60.0
        )
        repo = _CrashUndoesAWriteback(engine)
        repo.claim_lost = True
        publisher = Publisher(settings=settings, store=PublisherStore(repo))
        repo.owner = publisher.publisher_id
        async with asyncio.timeout(30):
            stats = await publisher.run(until_empty=True)
        final = rows(engine)
    finally:
        engine.dispose()
    undone = set(repo.undone)
    assert undone and repo.failed
    assert stats.confirmed == 300
    assert all(r.status == "confirmed" and r.published_at is not None for r in final)
    assert all(r.lost_confirms == 0 for r in final)
    assert f"{len(undone)} rows we had confirmed were set back" in caplog.text
    assert publisher.metrics.confirms_rewritten == len(undone)
    seen = await consume_ids(amqp_url, topology["queue"], expect=300)
    assert set(seen) == set(ids) and set(seen.values()) == {1}


async def test_messages_whose_insert_a_failover_undid_are_not_published_again(
    db_url: str, amqp_url: str, topology: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 49 (scenario 19e): the failover undid the rows' insert too (a Spark batch the
    publisher had drained), and the producer wrote the same messages again (Spark's replay),
    under new ids. They went out a second time, counted nowhere. The publisher keeps the
    message ids it confirmed; a claim that returns one settles it with the publish that
    reached the broker."""
    engine = make_engine(db_url)
    try:
        add_rows(engine, n=300, exchange=topology["exchange"], routing_key="rk")
        settings = settings_for(
            db_url=db_url, amqp_url=amqp_url, claim_batch=100, window=300, lease_seconds=60.0
        )
        repo = _CrashUndoesAWriteback(engine)
        repo.insert_lost = True
        async with running_publisher(settings, engine, store=PublisherStore(repo)) as publisher:
            repo.owner = publisher.publisher_id
            async with asyncio.timeout(30):
                while not repo.failed or publisher.claimer.vanished == {}:
                    await asyncio.sleep(0.02)
            gone = sorted(publisher.claimer.vanished)
            assert len(gone) == len(repo.undone)
            with engine.begin() as conn:  # the replay: the same messages, new ids
                conn.execute(
                    insert(outbox),
                    [
                        {
                            "message_id": m,
                            "batch_id": "replay:1",
                            "exchange": topology["exchange"],
                            "routing_key": "rk",
                            "body": b"x" * 256,
                        }
                        for m in gone
                    ],
                )
            async with asyncio.timeout(30):
                while any(r.status != "confirmed" for r in rows(engine)):
                    await asyncio.sleep(0.05)
        final = rows(engine)
    finally:
        engine.dispose()
    assert len(final) == 300 and all(r.status == "confirmed" for r in final)
    assert all(r.lost_confirms == 0 for r in final)
    assert publisher.metrics.confirms_rewritten == len(gone)
    assert f"{len(gone)} messages we had published and seen confirmed are gone" in caplog.text
    seen = await consume_ids(amqp_url, topology["queue"], expect=300)
    assert len(seen) == 300 and set(seen.values()) == {1}


async def test_reject_publish_nacks_retry_until_the_queue_drains(
    sqlite_url: str, amqp_url: str
) -> None:
    exchange, queue = _name("ex"), _name("q")
    limited = {"x-max-length": 10, "x-overflow": "reject-publish"}
    await declare(amqp_url, exchange=exchange, queue=queue, arguments=limited)
    engine = make_engine(sqlite_url)
    try:
        ids = add_rows(engine, n=40, exchange=exchange, max_attempts=100)
        settings = settings_for(db_url=sqlite_url, amqp_url=amqp_url, backoff_max=0.2)
        async with running_publisher(settings, engine) as publisher:
            await wait_rows(engine, lambda rs: sum(r.status == "confirmed" for r in rs) == 10)
            assert publisher.metrics.nacked >= 30  # the queue was full: real broker nacks
            seen = await consume_ids(amqp_url, queue, expect=40, timeout=60)
            final = await wait_rows(engine, all_in("confirmed"))
        assert set(seen) == set(ids) and set(seen.values()) == {1}
        assert max(r.attempts for r in final) > 1
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(queue,))


async def test_nacks_among_acks_spend_the_rows_nack_budget_and_end_nacked(
    sqlite_url: str, amqp_url: str
) -> None:
    """The exchange takes most rows (a queue bound with ``good``) and refuses some (a full
    reject-publish queue bound with ``bad``): nacks among acks are the rows' fault. Each bad row
    is nacked max_attempts (2) times and ends ``nacked`` with ``nacks`` 2; no outage."""
    exchange, good, bad = _name("ex"), _name("good"), _name("bad")
    await declare(amqp_url, exchange=exchange, queue=good, routing_key="good")
    full = {"x-max-length": 0, "x-overflow": "reject-publish"}
    await declare(amqp_url, exchange=exchange, queue=bad, arguments=full, routing_key="bad")
    engine = make_engine(sqlite_url)
    try:
        for i in range(10):
            add_rows(
                engine,
                n=2,
                exchange=exchange,
                routing_key="good",
                max_attempts=2,
                prefix=f"good-{i}",
            )
            add_rows(
                engine, n=1, exchange=exchange, routing_key="bad", max_attempts=2, prefix=f"bad-{i}"
            )
        settings = settings_for(db_url=sqlite_url, amqp_url=amqp_url)
        async with running_publisher(settings, engine) as publisher:
            final = await wait_rows(engine, all_in("confirmed", "nacked"))
            assert publisher.metrics.nacked == 20  # real broker nacks: 10 rows, twice each
            assert publisher.metrics.destination_outages == 0
        by_status = {s: [r for r in final if r.status == s] for s in ("confirmed", "nacked")}
        assert len(by_status["confirmed"]) == 20
        assert {r.message_id.split("-")[0] for r in by_status["nacked"]} == {"bad"}
        assert len(by_status["nacked"]) == 10
        assert all((r.nacks, r.attempts) == (2, 2) for r in by_status["nacked"])
        assert all(r.last_error == "nacked by the broker" for r in by_status["nacked"])
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(good, bad))


async def test_an_exchange_that_nacks_everything_is_an_outage_not_the_rows_fault(
    pg_url: str, amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every queue the exchange routes to is full (reject-publish): a burst of nacks pauses the
    exchange, its rows wait ``pending`` with ``nacks`` 0 (max_attempts 2 would have ended them
    ``nacked`` before), one log line and one outage counted. Once a queue that takes them is
    bound instead, a probe is confirmed and every row goes: the outage's end is logged with its
    duration."""
    exchange, full_q, open_q = _name("ex"), _name("full"), _name("open")
    full = {"x-max-length": 0, "x-overflow": "reject-publish"}
    await declare(amqp_url, exchange=exchange, queue=full_q, arguments=full)
    engine = make_engine(pg_url)
    caplog.set_level("INFO", logger="app.publisher")
    try:
        add_rows(engine, n=200, exchange=exchange, max_attempts=2)
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, destination_nack_burst=20)
        async with running_publisher(settings, engine) as publisher:
            deadline = asyncio.get_running_loop().time() + 20
            while publisher.metrics.postponed < 200:  # every row waited at least once
                assert asyncio.get_running_loop().time() < deadline, publisher.metrics.postponed
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)  # probes fail meanwhile: still one outage, no budget spent
            now = rows(engine)
            assert {r.status for r in now} <= {"pending", "in_flight"}
            assert max(r.nacks for r in now) == 0
            assert publisher.metrics.destination_outages == 1
            assert publisher.metrics.nacked >= 20
            assert publisher.metrics.reconnects >= 1  # a nacked probe: the next on a fresh one
            await declare(amqp_url, exchange=exchange, queue=open_q)
            await delete(amqp_url, queues=(full_q,))
            final = await wait_rows(engine, all_in("confirmed"))
            assert publisher.metrics.destination_outages == 1
        assert max(r.nacks for r in final) == 0
        text = caplog.text
        assert text.count(f"exchange {exchange!r} is out") == 1, text[-3000:]
        assert f"exchange {exchange!r} takes publishes again: its outage lasted" in text
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(full_q, open_q))


async def test_unroutable_rows_end_returned_312(db_url: str, engine: Engine, amqp_url: str) -> None:
    exchange = _name("unbound")
    await declare(amqp_url, exchange=exchange)
    try:
        add_rows(engine, n=20, exchange=exchange, routing_key="nowhere")
        settings = settings_for(db_url=db_url, amqp_url=amqp_url)
        async with running_publisher(settings, engine) as publisher:
            final = await wait_rows(engine, all_in("returned", "confirmed"))
        assert all(r.status == "returned" for r in final)
        assert {(r.reply_code, r.reply_text) for r in final} == {(312, "NO_ROUTE")}
        assert publisher.metrics.confirmed == 0
        for row in final:  # returned rows carry their publish facts too
            assert row.channel_id is not None and row.delivery_tag is not None, row
            assert row.published_at is not None and row.confirmed_at is not None, row
            assert row.published_at <= row.confirmed_at, row
    finally:
        await delete(amqp_url, exchanges=(exchange,))


async def test_missing_exchange_does_not_stall_other_exchanges(
    sqlite_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    engine = make_engine(sqlite_url)
    missing = _name("never-declared")
    try:
        good: list[str] = []
        for i in range(10):  # interleaved: 20 good rows, then 2 for the missing exchange, ...
            good += add_rows(engine, n=20, exchange=topology["exchange"], prefix=f"good{i}")
            add_rows(engine, n=2, exchange=missing, prefix=f"bad{i}")
        settings = settings_for(
            db_url=sqlite_url,
            amqp_url=amqp_url,
            destination_retry_budget=3,
            backoff_base=0.3,
            backoff_max=1.0,
        )
        async with running_publisher(settings, engine) as publisher:
            during = await wait_rows(
                engine, lambda rs: all(r.status == "confirmed" for r in rs if r.exchange != missing)
            )
            assert any(r.status != "failed" for r in during if r.exchange == missing)
            final = await wait_rows(engine, all_in("confirmed", "failed"))
        failed = [r for r in final if r.status == "failed"]
        assert {r.exchange for r in failed} == {missing} and len(failed) == 20
        assert all("NOT_FOUND" in (r.last_error or "") and r.attempts == 3 for r in failed)
        assert len({r.last_error for r in failed}) == 1  # one cause, one group in `failures`
        assert publisher.metrics.channel_closes == 0  # checked passively, never published
        seen = await consume_ids(amqp_url, topology["queue"], expect=200)
        assert set(seen) == set(good) and set(seen.values()) == {1}
    finally:
        engine.dispose()


async def test_exchange_deleted_under_the_publisher(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """The exchange existed when checked, then vanished: the broker closes the channel (404).
    Its rows back off and end failed; the other rows on that channel go out again."""
    doomed, doomed_q = _name("doomed"), _name("doomed-q")
    await declare(amqp_url, exchange=doomed, queue=doomed_q)
    engine = pg_engine
    settings = settings_for(
        db_url=pg_url, amqp_url=amqp_url, destination_retry_budget=2, window=200, claim_batch=200
    )
    try:
        async with running_publisher(settings, engine) as publisher:
            add_rows(engine, n=5, exchange=doomed, prefix="first")
            await wait_rows(engine, all_in("confirmed"))
            await delete(amqp_url, exchanges=(doomed,))
            good = add_rows(engine, n=150, exchange=topology["exchange"], prefix="g1")
            add_rows(engine, n=5, exchange=doomed, prefix="late")
            good += add_rows(engine, n=150, exchange=topology["exchange"], prefix="g2")
            final = await wait_rows(engine, all_in("confirmed", "failed"))
        late = [r for r in final if r.message_id.startswith("late")]
        assert all(r.status == "failed" and "NOT_FOUND" in (r.last_error or "") for r in late)
        assert all(r.status == "confirmed" for r in final if not r.message_id.startswith("late"))
        assert publisher.metrics.channel_closes >= 1
        seen = await consume_ids(amqp_url, topology["queue"], expect=300)
        assert set(seen) == set(good)
        duplicates = sum(seen.values()) - len(seen)
        assert duplicates <= sum(r.lost_confirms for r in final)
    finally:
        await delete(amqp_url, queues=(doomed_q,))


def _rabbitmqctl(*args: str) -> None:
    """rabbitmqctl on the suite's own node (its port, not the default one)."""
    subprocess.run(
        [str(SERVICES), "ctl", *args],
        check=True,
        capture_output=True,
        timeout=60,
        env=services_env(),
    )


async def test_access_refused_exchange_backs_off_alone(
    sqlite_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    user, password = _name("user"), uuid.uuid4().hex
    forbidden = _name("forbidden")
    await declare(amqp_url, exchange=forbidden)
    await asyncio.to_thread(_rabbitmqctl, "add_user", user, password)
    try:
        await asyncio.to_thread(
            _rabbitmqctl,
            "set_permissions",
            "-p",
            "/",
            user,
            ".*",
            "^(?!test-pub-forbidden-).*",
            ".*",
        )
        url = make_url(amqp_url.replace("amqp://", "postgresql://"))  # parse user/host/port
        limited = f"amqp://{user}:{password}@{url.host}:{url.port}/"
        engine = make_engine(sqlite_url)
        try:
            good = add_rows(engine, n=50, exchange=topology["exchange"], prefix="a")
            add_rows(engine, n=3, exchange=forbidden, prefix="f")
            good += add_rows(engine, n=50, exchange=topology["exchange"], prefix="b")
            settings = settings_for(db_url=sqlite_url, amqp_url=limited, destination_retry_budget=2)
            async with running_publisher(settings, engine) as publisher:
                final = await wait_rows(engine, all_in("confirmed", "failed"))
            refused = [r for r in final if r.exchange == forbidden]
            assert all(
                r.status == "failed" and "ACCESS_REFUSED" in (r.last_error or "") for r in refused
            )
            assert all(r.status == "confirmed" for r in final if r.exchange != forbidden)
            # The budget counts attempts: the broker refused the first; the second was refused
            # again or backed off at once while the exchange was still paused (a race between
            # the pause and the rows' own backoff): either way it ends the rows' budget.
            assert all(r.attempts >= 2 for r in refused)
            assert publisher.metrics.destination_errors >= 1
            seen = await consume_ids(amqp_url, topology["queue"], expect=100)
            assert set(seen) == set(good)
        finally:
            engine.dispose()
    finally:
        await asyncio.to_thread(_rabbitmqctl, "delete_user", user)
        await delete(amqp_url, exchanges=(forbidden,))


async def test_body_over_the_limit_fails_at_once(
    sqlite_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    engine = make_engine(sqlite_url)
    try:
        small = add_rows(engine, n=5, exchange=topology["exchange"], prefix="s")
        add_rows(engine, n=2, exchange=topology["exchange"], prefix="big", body=b"b" * 5000)
        small += add_rows(engine, n=5, exchange=topology["exchange"], prefix="t")
        settings = settings_for(db_url=sqlite_url, amqp_url=amqp_url, max_body_bytes=4096)
        async with running_publisher(settings, engine) as publisher:
            final = await wait_rows(engine, all_in("confirmed", "failed"))
        big = [r for r in final if r.message_id.startswith("big")]
        assert all(r.status == "failed" and r.attempts == 1 for r in big)
        assert all("larger than the limit of 4096 bytes" in (r.last_error or "") for r in big)
        assert publisher.metrics.published == 10
        seen = await consume_ids(amqp_url, topology["queue"], expect=10)
        assert set(seen) == set(small)
    finally:
        engine.dispose()


class _Proxy:
    """A TCP proxy to the broker that the test can cut (aio-pika's robust-proxy idea)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.hold = 0.0  # seconds a new connection waits before it reaches the broker
        self.accepted = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await asyncio.sleep(self.hold)
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def stop(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def test_cut_connection_republishes_on_a_fresh_one(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    url = make_url(amqp_url.replace("amqp://", "postgresql://"))
    proxy = _Proxy(url.host or "127.0.0.1", url.port or 5672)
    port = await proxy.start()
    try:
        ids = add_rows(pg_engine, n=5000, exchange=topology["exchange"])
        via_proxy = f"amqp://{url.username}:{url.password}@127.0.0.1:{port}/"
        settings = settings_for(db_url=pg_url, amqp_url=via_proxy, window=1000)
        async with running_publisher(settings, pg_engine) as publisher:
            await wait_rows(
                pg_engine, lambda rs: sum(r.status == "confirmed" for r in rs) > 500, timeout=30
            )
            proxy.cut()
            final = await wait_rows(pg_engine, all_in("confirmed"), timeout=60)
        assert publisher.metrics.reconnects >= 1
        seen = await consume_ids(amqp_url, topology["queue"], expect=5000)
        assert set(seen) == set(ids)
        duplicates = sum(seen.values()) - len(seen)
        assert duplicates <= sum(r.lost_confirms for r in final) <= 1000
    finally:
        await proxy.stop()


async def test_a_stop_while_a_reconnect_is_half_done_ends_promptly(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """The stop lands while a new connection is still in its handshake, after the session's
    close() has already looked for a connection and found none: the late connection is closed and
    the publisher stops within seconds, not at the 30 s task limit (seen once in CI)."""
    url = make_url(amqp_url.replace("amqp://", "postgresql://"))
    proxy = _Proxy(url.host or "127.0.0.1", url.port or 5672)
    port = await proxy.start()
    try:
        add_rows(pg_engine, n=200, exchange=topology["exchange"])
        via_proxy = f"amqp://{url.username}:{url.password}@127.0.0.1:{port}/"
        settings = settings_for(db_url=pg_url, amqp_url=via_proxy, shutdown_timeout=1.0)
        publisher = Publisher(settings=settings, store=PublisherStore(pg_engine))
        stop = asyncio.Event()
        task = asyncio.create_task(publisher.run(stop=stop))
        try:
            await wait_rows(pg_engine, all_in("confirmed"), timeout=30)
            proxy.hold = 2.0
            proxy.cut()
            deadline = asyncio.get_running_loop().time() + 10
            while proxy.accepted < 2:  # the reconnect is waiting in the proxy
                assert asyncio.get_running_loop().time() < deadline, "no reconnect attempt"
                await asyncio.sleep(0.02)
            started = asyncio.get_running_loop().time()
            stop.set()
            async with asyncio.timeout(15):
                await task
            took = asyncio.get_running_loop().time() - started
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        assert took < 10, f"the stop took {took:.1f}s"
        assert publisher.session.stopping
    finally:
        await proxy.stop()


async def test_two_publishers_share_one_postgres_outbox(
    pg_url: str, pg_engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    ids = add_rows(pg_engine, n=4000, exchange=topology["exchange"])
    settings = settings_for(db_url=pg_url, amqp_url=amqp_url, claim_batch=100, window=300)
    engines = [make_engine(pg_url) for _ in range(2)]
    try:
        publishers = [
            Publisher(settings=settings, store=PublisherStore(e), publisher_id=f"p{i}")
            for i, e in enumerate(engines)
        ]
        async with asyncio.timeout(120):
            stats = await asyncio.gather(*(p.run(until_empty=True) for p in publishers))
    finally:
        for e in engines:
            e.dispose()
    assert all(s.confirmed > 0 for s in stats)
    assert sum(s.confirmed for s in stats) == 4000
    assert all(r.status == "confirmed" for r in rows(pg_engine))
    seen = await consume_ids(amqp_url, topology["queue"], expect=4000)
    assert set(seen) == set(ids) and set(seen.values()) == {1}


async def test_refused_login_retries_and_fails_nothing(
    sqlite_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    url = make_url(amqp_url.replace("amqp://", "postgresql://"))
    wrong = f"amqp://{url.username}:not-the-password@{url.host}:{url.port}/"
    engine = make_engine(sqlite_url)
    try:
        add_rows(engine, n=3, exchange=topology["exchange"])
        settings = settings_for(db_url=sqlite_url, amqp_url=wrong, reconnect_max_delay=0.2)
        async with running_publisher(settings, engine) as publisher:
            async with asyncio.timeout(10):
                while publisher.metrics.connect_failures < 2:
                    await asyncio.sleep(0.05)
        assert {r.status for r in rows(engine)} == {"pending"}
        assert publisher.metrics.published == 0
    finally:
        engine.dispose()


async def test_a_broker_outage_is_logged_once_and_its_end_with_its_length(
    sqlite_url: str,
    amqp_url: str,
    topology: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker refuses connections for a while: many failed attempts, a bounded log (one
    WARNING, a reminder per REMINDER seconds, no line per attempt), the outage on the report, and
    one line with its length once a connection opens; every row confirmed."""
    monkeypatch.setattr(unreachable, "REMINDER", 1.0)
    caplog.set_level(logging.INFO, logger="app.publisher")
    split = make_url(amqp_url.replace("amqp://", "postgresql://"))
    proxy = TcpProxy(upstream_host=split.host or "127.0.0.1", upstream_port=split.port or 5672)
    await proxy.start()
    engine = make_engine(sqlite_url)
    try:
        add_rows(engine, n=20, exchange=topology["exchange"])
        url = proxy.url_for(amqp_url)
        settings = settings_for(db_url=sqlite_url, amqp_url=url, reconnect_max_delay=0.1)
        async with running_publisher(settings, engine) as publisher:
            await wait_rows(engine, all_in("confirmed"))
            await proxy.refuse()
            refused = time.monotonic()
            async with asyncio.timeout(20):
                while publisher.metrics.connect_failures < 25:
                    await asyncio.sleep(0.05)
            add_rows(engine, n=20, exchange=topology["exchange"])
            assert publisher.report().broker_unreachable_seconds > 1.0
            down = time.monotonic() - refused
            failures = publisher.metrics.connect_failures
            await proxy.accept()
            await wait_rows(engine, all_in("confirmed"))
            assert publisher.report().broker_unreachable_seconds == 0.0
    finally:
        engine.dispose()
        await proxy.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "app.publisher"]
    began = [line for line in lines if line.startswith("cannot connect to the broker")]
    reminders = [line for line in lines if line.startswith("broker still unreachable")]
    assert len(began) == 1, began
    assert not [line for line in lines if "next connection attempt" in line]
    assert len(reminders) <= down + 2  # one a second here (REMINDER patched), not one an attempt
    assert failures >= 25 > len(began) + len(reminders)
    ended = [
        m
        for line in lines
        if (m := re.search(r"answers again after ([0-9.]+)s \((\d+) conn", line))
    ]
    assert len(ended) == 1
    assert float(ended[0][1]) >= down - 0.5 and int(ended[0][2]) >= failures


async def test_several_channels_share_the_window(
    sqlite_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    engine = make_engine(sqlite_url)
    try:
        ids = add_rows(engine, n=3000, exchange=topology["exchange"])
        settings = settings_for(
            db_url=sqlite_url, amqp_url=amqp_url, channels=3, window=900, claim_batch=100
        )
        stats = await run_until_empty(settings, engine)
        assert stats.confirmed == 3000 and stats.lost == 0
        assert all(r.status == "confirmed" for r in rows(engine))
    finally:
        engine.dispose()
    seen = await consume_ids(amqp_url, topology["queue"], expect=3000)
    assert set(seen) == set(ids) and set(seen.values()) == {1}


async def test_each_write_back_sends_its_settings_in_one_round_trip(
    pg_engine: Engine, pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    """A write-back's transaction sends ONE settings statement before its updates: the commit
    that does not wait for the disk and the plans by id (``unit_of_work(by_id=True)``), where
    there were two round trips. Seen on a real drain: every transaction that writes outcomes
    back."""
    add_rows(pg_engine, n=600, exchange=topology["exchange"], routing_key="rk")
    transactions: dict[int, list[str]] = collections.defaultdict(list)
    done: list[list[str]] = []

    def sent(conn: Connection, _cur: Any, statement: str, *_: Any) -> None:
        transactions[id(conn)].append(statement)

    def committed(conn: Connection) -> None:
        done.append(transactions.pop(id(conn), []))

    def rolled_back(conn: Connection) -> None:  # reads end so: their statements go with them
        transactions.pop(id(conn), None)

    event.listen(pg_engine, "before_cursor_execute", sent)
    event.listen(pg_engine, "commit", committed)
    event.listen(pg_engine, "rollback", rolled_back)
    try:
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, claim_batch=100, window=200)
        stats = await run_until_empty(settings, pg_engine)
    finally:
        event.remove(pg_engine, "before_cursor_execute", sent)
        event.remove(pg_engine, "commit", committed)
        event.remove(pg_engine, "rollback", rolled_back)
    assert stats.confirmed == 600
    write_backs = [t for t in done if any("unnest" in s and "UPDATE outbox" in s for s in t)]
    assert write_backs
    for statements in write_backs:
        settings_sent = [s for s in statements if "set_config" in s or "SET LOCAL" in s]
        assert len(settings_sent) == 1, settings_sent
        (one,) = settings_sent
        assert "'synchronous_commit', 'off'" in one and "'enable_seqscan', 'off'" in one, one
        assert statements[0] == one  # before any statement it shapes


async def test_write_backs_are_forgotten_once_postgres_says_they_are_on_disk(
    pg_engine: Engine, pg_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    """Issue 44: the rows of a write-back committed without waiting for the disk are kept as
    "a crash may undo this" until the server's WAL on disk has passed its commit, read from the
    next write-back's first statement, not for a fixed 2 s. On a real drain the publisher ends
    remembering only the write-backs after the last WAL flush it heard of."""
    add_rows(pg_engine, n=3000, exchange=topology["exchange"], routing_key="rk")
    settings = settings_for(db_url=pg_url, amqp_url=amqp_url, claim_batch=100, window=300)
    publisher = Publisher(settings=settings, store=PublisherStore(pg_engine))
    with pg_engine.connect() as conn:  # the server's own record of its WAL, to compare with
        before = conn.exec_driver_sql("SELECT pg_current_wal_insert_lsn() - '0/0'").scalar_one()
    async with asyncio.timeout(120):
        stats = await publisher.run(until_empty=True)
    assert stats.confirmed == 3000
    flushes = publisher.metrics.flushes
    kept = list(publisher.writeback._undoable)
    assert flushes >= 5 and len(kept) < flushes / 2, (flushes, len(kept))
    ends = [e.end for e in kept if e.end is not None]
    assert all(int(end) > int(before) for end in ends)  # positions of this run's WAL
    assert kept[-1].end is None  # the last one: no later write-back has told where it ended
