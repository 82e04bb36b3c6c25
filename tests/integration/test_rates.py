"""The overview's rates (``queries.rates``) on PostgreSQL and SQLite, from rows the repository
wrote, claimed, confirmed and failed as the publisher does, checked minute by minute."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Engine, func, select

from app.outbox import queries
from app.outbox.schema import outbox
from app.outbox.states import Status
from tests.factories import add_rows
from tests.integration.test_api import T0, Clock
from tests.outbox_clients import OutboxClients


def _write_and_settle(
    repo: OutboxClients, engine: Engine, clock: Clock, *, n: int, confirm: bool
) -> None:
    """``n`` rows written now, claimed, and confirmed or failed a second later."""
    add_rows(engine, n=n, created_at=clock.now, available_at=clock.now)
    got = repo.store.claim(owner="p1", limit=n, lease_seconds=600)
    assert len(got) == n
    clock.advance(1)
    ids = [r.id for r in got]
    if confirm:
        repo.store.record_published(owner="p1", channel_id=1, tags=[(i, i) for i in ids])
        repo.store.mark_confirmed(owner="p1", ids=ids)
    else:
        repo.store.mark_failed(owner="p1", ids=ids, reason="body too large")


def test_rates_count_each_minute_of_the_last_hour(engine: Engine) -> None:
    clock = Clock(T0)
    repo = OutboxClients(engine, clock=clock)
    # two hours before the window: written, never claimed (still pending, not counted)
    add_rows(engine, n=4, created_at=T0 - dt.timedelta(hours=2))
    # minute 10 of the window: 3 confirmed; minute 50: 2 confirmed and 1 failed; minute 59: 5
    # written and left pending
    start = T0
    clock.now = start + dt.timedelta(minutes=10, seconds=5)
    _write_and_settle(repo, engine, clock, n=3, confirm=True)
    clock.now = start + dt.timedelta(minutes=50, seconds=30)
    _write_and_settle(repo, engine, clock, n=2, confirm=True)
    _write_and_settle(repo, engine, clock, n=1, confirm=False)
    add_rows(engine, n=5, created_at=start + dt.timedelta(minutes=59, seconds=59))
    now = start + dt.timedelta(hours=1)

    rates = queries.rates(engine, now=now)

    assert (rates.start, rates.end, len(rates.written)) == (start, now, 60)
    assert {i: c for i, c in enumerate(rates.written) if c} == {10: 3, 50: 3, 59: 5}
    assert {i: c for i, c in enumerate(rates.confirmed) if c} == {10: 3, 50: 2}
    assert {i: c for i, c in enumerate(rates.failed) if c} == {50: 1}
    with engine.connect() as conn:
        since = outbox.c.created_at >= start
        assert sum(rates.written) == conn.execute(select(func.count()).where(since)).scalar()
        confirmed = select(func.count()).where(outbox.c.status == Status.CONFIRMED)
        assert sum(rates.confirmed) == conn.execute(confirmed).scalar()


def test_a_confirm_of_a_row_written_before_the_lookback_is_not_counted(engine: Engine) -> None:
    clock = Clock(T0)
    repo = OutboxClients(engine, clock=clock)
    _write_and_settle(repo, engine, clock, n=2, confirm=False)  # failed at T0 (before the window)
    clock.now = T0 + queries.RATE_LOOKBACK + dt.timedelta(minutes=30)
    add_rows(engine, n=1, created_at=T0, available_at=T0, prefix="old")
    got = repo.store.claim(owner="p1", limit=1, lease_seconds=600)
    repo.store.record_published(owner="p1", channel_id=1, tags=[(got[0].id, 1)])
    repo.store.mark_confirmed(owner="p1", ids=[got[0].id])

    rates = queries.rates(engine, now=clock.now + dt.timedelta(minutes=1))

    assert sum(rates.confirmed) == 0 and sum(rates.written) == 0 and sum(rates.failed) == 0
    assert rates.lookback == queries.RATE_LOOKBACK
