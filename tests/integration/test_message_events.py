"""The append-only history of a message's rare events (``outbox_events``, issue #28), written by
the repository's own write-back and operator methods, on PostgreSQL and on SQLite; the confirm
path writes nothing there."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import Engine, func, select

from app.outbox.read.messages import message_events
from app.outbox.records import Backoff, ReturnedRow
from app.outbox.schema import events, outbox
from app.outbox.scope import RepublishFilter
from app.outbox.states import Status
from tests.support.clock import Clock
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

GONE = "exchange 'gone' not found (404)"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def repo(engine: Engine, clock: Clock) -> OutboxClients:
    return OutboxClients(engine, clock=clock)


def _write(engine: Engine, clock: Clock, n: int = 1) -> list[str]:
    return add_rows(engine, n=n, created_at=clock.now, available_at=clock.now)


def _claim(repo: OutboxClients, n: int = 1) -> list[int]:
    got = repo.store.claim(owner="p1", limit=n, lease_seconds=60)
    assert len(got) == n
    repo.store.record_published(
        owner="p1", channel_id=1, tags=[(r.id, i + 1) for i, r in enumerate(got)]
    )
    return [r.id for r in got]


def _kinds(engine: Engine, message_id: str) -> list[tuple[str, int, str | None]]:
    with engine.connect() as conn:
        oid = conn.execute(select(outbox.c.id).where(outbox.c.message_id == message_id)).scalar()
    assert oid is not None
    return [(e.kind, e.attempt, e.detail) for e in message_events(engine, outbox_id=oid)]


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(events)).scalar_one())


def test_two_failures_a_republish_and_a_confirm_are_all_kept(
    repo: OutboxClients, engine: Engine, clock: Clock
) -> None:
    (mid,) = _write(engine, clock)
    ids = _claim(repo)
    retry = {
        "owner": "p1",
        "ids": ids,
        "error": GONE,
        "backoff": Backoff(base=0.1, cap=0.1),
        "exhausted": Status.FAILED,
        "max_attempts": 2,
    }
    assert repo.store.retry(**retry).retried == 1  # type: ignore[arg-type]
    clock.advance(1)
    _claim(repo)
    assert repo.store.retry(**retry).exhausted == 1  # type: ignore[arg-type]
    clock.advance(60)
    moved = repo.actions.republish(
        actor="alice",
        filter=RepublishFilter.of(message_id=mid),
        limit=10,
        dry_run=False,
        request_id="r-1",
    )
    assert moved.count == 1
    before_confirm = _count(engine)
    _claim(repo)
    repo.store.mark_confirmed(owner="p1", ids=ids)
    assert _count(engine) == before_confirm == 3  # the claim, publish and confirm add nothing
    assert _kinds(engine, mid) == [
        ("retry", 1, GONE),
        ("failed", 2, GONE),
        ("republished", 2, GONE),
    ]
    with engine.connect() as conn:
        last = conn.execute(select(events).order_by(events.c.id.desc()).limit(1)).mappings().one()
    assert (last["actor"], last["audit_id"], last["from_status"]) == (
        "alice",
        moved.audit_id,
        "failed",
    )


def test_a_return_a_nack_a_lost_confirm_and_a_skip_are_kept(
    repo: OutboxClients, engine: Engine, clock: Clock
) -> None:
    returned, nacked, lost = _write(engine, clock, 3)
    ids = _claim(repo, 3)
    repo.store.mark_returned(owner="p1", returns=[ReturnedRow(ids[0], 312, "NO_ROUTE")])
    repo.store.retry(
        owner="p1",
        ids=[ids[1]],
        error="nacked by the broker",
        backoff=Backoff(),
        exhausted=Status.NACKED,
        max_attempts=1,
    )
    repo.store.release(owner="p1", ids=[ids[2]], lost=True, error="channel closed")
    repo.actions.skip(actor="bob", message_id=nacked, reason="replaced by order 7")
    assert _kinds(engine, returned) == [("returned", 1, "returned by broker: 312 NO_ROUTE")]
    assert _kinds(engine, nacked) == [
        ("nacked", 1, "nacked by the broker"),
        ("skipped", 1, "replaced by order 7"),
    ]
    assert _kinds(engine, lost) == [("lost", 1, "channel closed")]
    with engine.connect() as conn:
        code = conn.execute(select(events.c.reply_code).where(events.c.kind == "returned"))
        assert code.scalar() == 312


def test_the_confirm_path_writes_no_event(
    repo: OutboxClients, engine: Engine, clock: Clock
) -> None:
    _write(engine, clock, 200)
    ids = _claim(repo, 200)
    repo.store.mark_confirmed(owner="p1", ids=ids)
    repo.store.release(owner="p1", ids=ids, lost=False)  # a clean stop's release: no event either
    assert _count(engine) == 0


def test_a_purged_row_takes_its_events_with_it(
    repo: OutboxClients, engine: Engine, clock: Clock
) -> None:
    kept, purged = _write(engine, clock, 2)
    ids = _claim(repo, 2)
    repo.store.release(owner="p1", ids=ids, lost=True, error="channel closed")
    _claim(repo, 2)
    repo.store.mark_confirmed(owner="p1", ids=ids[1:])
    repo.store.mark_failed(owner="p1", ids=ids[:1], reason="body too large")
    clock.advance(86400 * 8)
    assert repo.retention.purge_confirmed(older_than=dt.timedelta(days=7)) == 1
    assert [k for k, _a, _d in _kinds(engine, kept)] == ["lost", "failed"]
    with engine.connect() as conn:
        left = conn.execute(select(events.c.message_id).distinct()).scalars().all()
    assert left == [kept] and purged not in left
