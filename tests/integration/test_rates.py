"""The overview's rates (``app.outbox.read.rates``) on PostgreSQL and SQLite, from the samples the
publishers write (``PublisherRegistry.record_sample``, the call a publisher's housekeeping
makes each sample interval), checked minute by minute; and a real publisher's samples."""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import Engine, func, select

from app.outbox.read.rates import rates as read_rates
from app.outbox.schema import samples
from tests.support.api import T0, Clock
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients
from tests.support.publisher import declare, delete, run_until_empty, settings_for


def _sample(
    repo: OutboxClients,
    publisher: str,
    *,
    confirmed: int,
    failed: int = 0,
    p50: float | None = None,
    p99: float | None = None,
) -> None:
    repo.registry.record_sample(
        publisher_id=publisher,
        published=confirmed + failed,
        confirmed=confirmed,
        failed=failed,
        lost=0,
        latency_p50_ms=p50,
        latency_p99_ms=p99,
    )


def test_rates_are_the_differences_of_each_publishers_samples(engine: Engine) -> None:
    clock = Clock(T0 - dt.timedelta(minutes=30))
    repo = OutboxClients(engine, clock=clock)
    # baselines before the window (half an hour before it starts): not counted, but the
    # start of each publisher's first difference and of the highest id
    add_rows(engine, n=4)
    _sample(repo, "p1", confirmed=100)
    _sample(repo, "p2", confirmed=7)
    # minute 10: 3 rows written; p1 confirmed 3 more with latency p50 4 ms, p99 40 ms
    clock.now = T0 + dt.timedelta(minutes=10, seconds=5)
    add_rows(engine, n=3)
    _sample(repo, "p1", confirmed=103, p50=4.0, p99=40.0)
    # minute 50: p1 confirmed 2 (p50 10 ms), p2 confirmed 6 (p50 2 ms, p99 80) and failed 1
    clock.now = T0 + dt.timedelta(minutes=50, seconds=30)
    add_rows(engine, n=3)
    _sample(repo, "p1", confirmed=105, p50=10.0, p99=20.0)
    _sample(repo, "p2", confirmed=13, failed=1, p50=2.0, p99=80.0)
    # minute 59: 5 written, nothing settled (p2 restarted: a lower count adds nothing)
    clock.now = T0 + dt.timedelta(minutes=59, seconds=59)
    add_rows(engine, n=5)
    _sample(repo, "p1", confirmed=105)
    _sample(repo, "p2", confirmed=0)
    now = T0 + dt.timedelta(hours=1)

    rates = read_rates(engine, now=now)

    assert (rates.start, rates.end, len(rates.written), rates.sampled) == (T0, now, 60, True)
    assert {i: c for i, c in enumerate(rates.written) if c} == {10: 3, 50: 3, 59: 5}
    assert {i: c for i, c in enumerate(rates.confirmed) if c} == {10: 3, 50: 8}
    assert {i: c for i, c in enumerate(rates.failed) if c} == {50: 1}
    known = {i: (rates.latency_p50_ms[i], rates.latency_p99_ms[i]) for i in (10, 50)}
    assert known == {10: (4.0, 40.0), 50: (2.0, 80.0)}  # p50 weighted by confirms: 6 vs 2
    assert rates.latency_p50_ms[59] is None and rates.latency_p99_ms[0] is None


def test_without_samples_in_the_window_the_rates_say_they_are_blind(engine: Engine) -> None:
    clock = Clock(T0)
    repo = OutboxClients(engine, clock=clock)
    _sample(repo, "p1", confirmed=5)
    add_rows(engine, n=10)
    rates = read_rates(engine, now=T0 + dt.timedelta(hours=3))
    assert not rates.sampled
    assert sum(rates.written) == sum(rates.confirmed) == sum(rates.failed) == 0


async def test_a_publisher_samples_what_it_confirmed(pg_url: str, amqp_url: str) -> None:
    """The real publisher, sampling every second, drains 300 rows: its samples add up to what
    it confirmed, the highest id to what was written, and the rates of the window show both."""
    from app.db import make_engine

    exchange = queue = f"test-rates-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=exchange, queue=queue)
    engine = make_engine(pg_url)
    try:
        ids = add_rows(engine, n=300, exchange=exchange)
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, publisher_sample_interval=1.0)
        stats = await run_until_empty(settings, engine)
        assert stats.confirmed == 300
        with engine.connect() as conn:
            got = conn.execute(
                select(func.count(), func.max(samples.c.confirmed), func.max(samples.c.max_id))
            ).one()
        assert got[0] >= 2 and got[1] == 300  # the first sample at the start, the last at the stop
        assert got[2] is not None and got[2] >= len(ids)
        rates = read_rates(engine, now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))
        assert rates.sampled and sum(rates.confirmed) == 300
        assert any(v is not None for v in rates.latency_p99_ms)
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(queue,))


def test_the_purge_deletes_samples_past_the_retention(engine: Engine) -> None:
    clock = Clock(T0 - dt.timedelta(days=10))
    repo = OutboxClients(engine, clock=clock)
    _sample(repo, "p1", confirmed=1)
    clock.now = T0
    _sample(repo, "p1", confirmed=2)
    repo.retention.purge_confirmed(older_than=dt.timedelta(days=7))
    with engine.connect() as conn:
        assert conn.execute(select(samples.c.confirmed)).scalars().all() == [2]
