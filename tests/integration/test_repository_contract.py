"""One behaviour contract for the outbox repository, run on PostgreSQL and on SQLite.

Time is injected (a settable clock), so leases and backoff are tested without sleeping.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from app.api.models import StatsOut
from app.cli import render_stats
from app.db import make_engine
from app.outbox.enqueue import Message, enqueue
from app.outbox.health import verdict
from app.outbox.read.metrics import metrics_snapshot
from app.outbox.read.stats import read_stats
from app.outbox.records import Backoff, Published, ReturnedRow
from app.outbox.registry import PublisherLocked
from app.outbox.schema import audit, outbox, publishers
from app.outbox.scope import RepublishFilter
from app.outbox.states import TRANSITIONS, IllegalTransition, Status
from tests.support.clock import T0, Clock
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def repo(engine: Engine, clock: Clock) -> OutboxClients:
    return OutboxClients(engine, clock=clock)


def seed(engine: Engine, n: int, **kw: object) -> list[str]:
    return add_rows(engine, n=n, available_at=T0 - dt.timedelta(seconds=1), **kw)  # type: ignore[arg-type]


def statuses(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(select(outbox.c.status, func.count()).group_by(outbox.c.status)).all()
    return {status: count for status, count in rows}


def row(engine: Engine, row_id: int) -> dict[str, object]:
    with engine.connect() as conn:
        return dict(conn.execute(select(outbox).where(outbox.c.id == row_id)).mappings().one())


class TestRepositoryContract:
    def test_claim_takes_due_rows_oldest_first_under_lease(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 5)
        got = repo.store.claim(owner="p1", limit=3, lease_seconds=30)
        assert [r.id for r in got] == sorted(r.id for r in got)
        assert len(got) == 3 and all(r.attempts == 1 for r in got)
        assert got[0].body == b"x" * 256 and got[0].mandatory is True
        r0 = row(engine, got[0].id)
        assert r0["status"] == "in_flight" and r0["lease_owner"] == "p1"
        assert r0["lease_until"] == T0 + dt.timedelta(seconds=30)
        assert statuses(engine) == {"in_flight": 3, "pending": 2}

    def test_claim_skips_rows_not_yet_due(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        add_rows(engine, n=2, available_at=T0 + dt.timedelta(seconds=10))
        assert repo.store.claim(owner="p1", limit=10, lease_seconds=30) == []
        clock.advance(11)
        assert len(repo.store.claim(owner="p1", limit=10, lease_seconds=30)) == 2

    def test_two_concurrent_claimers_never_get_the_same_row(
        self, db_url: str, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 600)
        claimed: dict[str, list[int]] = {"a": [], "b": []}

        def claimer(owner: str) -> None:
            own = OutboxClients(make_engine(db_url), clock=clock)
            for _ in range(200):
                rows = own.store.claim(owner=owner, limit=7, lease_seconds=30)
                if not rows and not statuses(engine).get("pending"):
                    break
                claimed[owner].extend(r.id for r in rows)
            own.db.engine.dispose()

        threads = [threading.Thread(target=claimer, args=(o,)) for o in claimed]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        both = claimed["a"] + claimed["b"]
        assert len(both) == 600 and len(set(both)) == 600
        assert set(claimed["a"]).isdisjoint(claimed["b"])

    def test_expired_lease_returns_rows_to_pending(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 4)
        got = repo.store.claim(owner="dead", limit=4, lease_seconds=30)
        repo.store.record_published(
            owner="dead", channel_id=1, tags=[(got[0].id, 1), (got[1].id, 2)]
        )
        clock.advance(29)
        assert repo.store.release_expired() == 0
        clock.advance(2)
        assert repo.store.release_expired() == 4
        assert statuses(engine) == {"pending": 4}
        # every expired row may have been on the wire: each counts a possible duplicate
        assert [row(engine, r.id)["lost_confirms"] for r in got] == [1, 1, 1, 1]

    def test_heartbeat_extends_the_lease(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 2)
        repo.registry.register_publisher(publisher_id="p1", stale_after=30)
        repo.store.claim(owner="p1", limit=2, lease_seconds=30)
        clock.advance(20)
        assert (
            repo.registry.heartbeat(publisher_id="p1", lease_seconds=30, stats={"confirmed": 7})
            == 2
        )
        with engine.connect() as conn:
            assert conn.execute(select(publishers.c.stats)).scalar_one() == {"confirmed": 7}
        clock.advance(20)
        assert repo.store.release_expired() == 0

    def test_heartbeat_renews_only_rows_the_process_holds(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 3)
        repo.registry.register_publisher(publisher_id="p1", stale_after=30)
        a, b, orphan = repo.store.claim(owner="p1", limit=3, lease_seconds=30)
        assert sorted(repo.store.leased_ids(owner="p1")) == sorted([a.id, b.id, orphan.id])
        clock.advance(20)
        assert repo.registry.heartbeat(publisher_id="p1", lease_seconds=30, held=[a.id, b.id]) == 2
        clock.advance(20)
        assert repo.store.release_expired() == 1  # the row whose claim reply was lost comes back
        assert row(engine, orphan.id)["status"] == "pending"
        assert repo.registry.heartbeat(publisher_id="p1", lease_seconds=30, held=[]) == 0

    def test_mark_from_publisher_that_lost_its_lease_is_refused(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 3)
        old = repo.store.claim(owner="slow", limit=3, lease_seconds=10)
        clock.advance(11)
        repo.store.release_expired()
        new = repo.store.claim(owner="fresh", limit=3, lease_seconds=10)
        ids = [r.id for r in old]
        assert repo.store.mark_confirmed(owner="slow", ids=ids) == 0
        assert repo.store.mark_failed(owner="slow", ids=ids, reason="x") == 0
        assert repo.store.release(owner="slow", ids=ids, lost=True) == 0
        repo.store.record_published(owner="slow", channel_id=9, tags=[(ids[0], 5)])
        assert row(engine, ids[0])["delivery_tag"] is None  # the guarded update touched nothing
        assert repo.store.mark_confirmed(owner="fresh", ids=[r.id for r in new]) == 3
        assert statuses(engine) == {"confirmed": 3}

    def test_every_transition_outside_the_table_raises(self, repo: OutboxClients) -> None:
        illegal = [e for e in itertools.product(Status, Status) if e not in TRANSITIONS]
        assert len(illegal) == len(Status) ** 2 - len(TRANSITIONS)
        for source, target in illegal:
            with pytest.raises(IllegalTransition):
                repo.db.transition(ids=[1], source=source, target=target)

    def test_confirm_return_fail_mark_only_held_rows(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 3)
        a, b, c = repo.store.claim(owner="p1", limit=3, lease_seconds=30)
        repo.store.record_published(
            owner="p1", channel_id=2, tags=[(a.id, 1), (b.id, 2), (c.id, 3)]
        )
        assert row(engine, a.id)["delivery_tag"] == 1 and row(engine, c.id)["channel_id"] == 2
        assert repo.store.mark_confirmed(owner="p1", ids=[a.id]) == 1
        assert (
            repo.store.mark_returned(owner="p1", returns=[ReturnedRow(b.id, 312, "NO_ROUTE")]) == 1
        )
        assert repo.store.mark_failed(owner="p1", ids=[c.id], reason="body too large") == 1
        assert row(engine, a.id)["confirmed_at"] == T0
        rb, rc = row(engine, b.id), row(engine, c.id)
        assert (rb["status"], rb["reply_code"], rb["reply_text"]) == ("returned", 312, "NO_ROUTE")
        assert (rc["status"], rc["last_error"]) == ("failed", "body too large")
        assert (
            repo.store.mark_confirmed(owner="p1", ids=[b.id, c.id]) == 0
        )  # terminal stays terminal

    def test_retry_backs_off_then_exhausts(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 1, max_attempts=2)
        backoff = Backoff(base=4, cap=60)
        (r,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30)
        out = repo.store.retry(
            owner="p1", ids=[r.id], error="nacked", backoff=backoff, exhausted=Status.NACKED
        )
        assert (out.retried, out.exhausted) == (1, 0)
        due = row(engine, r.id)["available_at"]
        assert isinstance(due, dt.datetime) and T0 + dt.timedelta(seconds=2) <= due
        assert due <= T0 + dt.timedelta(seconds=4)
        assert repo.store.claim(owner="p1", limit=1, lease_seconds=30) == []
        clock.advance(4)
        (r,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30)
        assert r.attempts == 2
        out = repo.store.retry(
            owner="p1", ids=[r.id], error="nacked", backoff=backoff, exhausted=Status.NACKED
        )
        assert (out.retried, out.exhausted) == (0, 1)
        assert (row(engine, r.id)["status"], row(engine, r.id)["last_error"]) == (
            "nacked",
            "nacked",
        )

    def test_nacks_have_their_own_budget_apart_from_lost_confirms(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        """Three lost confirms (a cluster failover each) then two nacks, max_attempts 2: the
        lost confirms spend attempts, not the nack budget; the second nack ends the row."""
        seed(engine, 1, max_attempts=2)
        for _ in range(3):
            (r,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30)
            assert (
                repo.store.release(owner="p1", ids=[r.id], lost=True, error="connection lost") == 1
            )
        (r,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30)
        assert r.attempts == 4
        out = repo.store.retry(
            owner="p1",
            ids=[r.id],
            error="nacked by the broker",
            backoff=Backoff(base=1, cap=1),
            exhausted=Status.NACKED,
            nack=True,
        )
        assert (out.retried, out.exhausted) == (1, 0)
        assert (row(engine, r.id)["nacks"], row(engine, r.id)["status"]) == (1, "pending")
        clock.advance(2)
        (r,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30)
        out = repo.store.retry(
            owner="p1",
            ids=[r.id],
            error="nacked by the broker",
            backoff=Backoff(base=1, cap=1),
            exhausted=Status.NACKED,
            nack=True,
        )
        assert (out.retried, out.exhausted) == (0, 1)
        final = row(engine, r.id)
        assert (final["status"], final["nacks"], final["attempts"]) == ("nacked", 2, 5)
        assert final["lost_confirms"] == 3

    def test_retry_with_destination_budget_fails_rows(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 2)
        rows = repo.store.claim(owner="p1", limit=2, lease_seconds=30)
        out = repo.store.retry(
            owner="p1",
            ids=[r.id for r in rows],
            error="404 no exchange",
            backoff=Backoff(),
            exhausted=Status.FAILED,
            max_attempts=1,
        )
        assert (out.retried, out.exhausted) == (0, 2)
        assert statuses(engine) == {"failed": 2}

    def test_release_counts_lost_confirms(self, repo: OutboxClients, engine: Engine) -> None:
        seed(engine, 2)
        a, b = repo.store.claim(owner="p1", limit=2, lease_seconds=30)
        assert repo.store.release(owner="p1", ids=[a.id], lost=True, error="channel closed") == 1
        assert repo.store.release(owner="p1", ids=[b.id], lost=False) == 1
        assert row(engine, a.id)["lost_confirms"] == 1 and row(engine, b.id)["lost_confirms"] == 0
        assert row(engine, a.id)["last_error"] == "channel closed"
        assert len(repo.store.claim(owner="p2", limit=5, lease_seconds=30)) == 2

    def test_republish_moves_only_filtered_terminal_rows_and_audits(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 3, batch_id="orders:1")
        seed(engine, 2, batch_id="orders:2")
        rows = repo.store.claim(owner="p1", limit=5, lease_seconds=30)
        one, two = rows[:3], rows[3:]
        repo.store.retry(
            owner="p1",
            ids=[one[0].id],
            error="nack",
            backoff=Backoff(),
            exhausted=Status.NACKED,
            max_attempts=1,
        )
        repo.store.mark_returned(owner="p1", returns=[ReturnedRow(one[1].id, 312, "NO_ROUTE")])
        repo.store.mark_confirmed(owner="p1", ids=[one[2].id])
        repo.store.mark_failed(owner="p1", ids=[r.id for r in two], reason="404")

        flt = RepublishFilter(batch_id="orders:1")
        dry = repo.actions.republish(actor="alice", filter=flt, limit=100, dry_run=True)
        assert (dry.count, dry.matched, dry.audit_id) == (2, 2, None)
        assert statuses(engine)["nacked"] == 1

        res = repo.actions.republish(
            actor="alice", filter=flt, limit=100, dry_run=False, request_id="r1"
        )
        assert res.count == 2 and sorted(res.sample) == sorted(
            [one[0].message_id, one[1].message_id]
        )
        assert statuses(engine) == {"pending": 2, "confirmed": 1, "failed": 2}
        assert row(engine, one[0].id)["attempts"] == 0
        with engine.connect() as conn:
            (entry,) = conn.execute(select(audit)).mappings().all()
        assert (entry["actor"], entry["action"], entry["count"]) == ("alice", "republish", 2)
        assert entry["filter"]["batch_id"] == "orders:1" and entry["request_id"] == "r1"

        again = repo.actions.republish(
            actor="alice", filter=flt, limit=100, dry_run=False, request_id="r1"
        )
        assert again.replayed and again.count == 2 and again.audit_id == res.audit_id

        only_failed = RepublishFilter(statuses=frozenset({Status.FAILED}))
        assert (
            repo.actions.republish(actor="bob", filter=only_failed, limit=1, dry_run=False).count
            == 1
        )
        assert statuses(engine) == {"pending": 3, "confirmed": 1, "failed": 1}

    def test_republish_refuses_non_terminal_statuses(self) -> None:
        with pytest.raises(ValueError, match="republish takes statuses"):
            RepublishFilter(statuses=frozenset({Status.CONFIRMED}))

    def test_retention_deletes_only_old_confirmed_rows(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 7)
        rows = repo.store.claim(owner="p1", limit=7, lease_seconds=30)
        repo.store.mark_confirmed(owner="p1", ids=[r.id for r in rows[:5]])
        repo.store.mark_failed(owner="p1", ids=[rows[5].id], reason="x")
        clock.advance(3600)
        (young,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30) or [None]
        assert young is None
        repo.store.release(owner="p1", ids=[rows[6].id], lost=False)
        (r6,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30)
        repo.store.mark_confirmed(owner="p1", ids=[r6.id])  # confirmed one hour later than the rest
        clock.advance(60)
        assert repo.retention.purge_confirmed(older_than=dt.timedelta(minutes=30), chunk=2) == 5
        assert statuses(engine) == {"confirmed": 1, "failed": 1}

    def test_a_paced_purge_sleeps_after_each_chunk_that_deleted_rows(
        self, repo: OutboxClients, engine: Engine, clock: Clock
    ) -> None:
        seed(engine, 5)
        rows = repo.store.claim(owner="p1", limit=5, lease_seconds=30)
        repo.store.mark_confirmed(owner="p1", ids=[r.id for r in rows])
        clock.advance(3600)
        slept: list[float] = []
        deleted = repo.retention.purge_confirmed(
            older_than=dt.timedelta(minutes=30), chunk=2, sleep_coef=3.0, sleep=slept.append
        )
        # three chunks deleted rows (2, 2, 1); the last one ends the walk without a pause
        assert deleted == 5 and statuses(engine) == {}
        assert len(slept) == 2 and all(s > 0 for s in slept)
        seed(engine, 3)
        rows = repo.store.claim(owner="p1", limit=3, lease_seconds=30)
        repo.store.mark_confirmed(owner="p1", ids=[r.id for r in rows])
        clock.advance(3600)
        unpaced: list[float] = []
        assert (
            repo.retention.purge_confirmed(
                older_than=dt.timedelta(minutes=30), chunk=1, sleep=unpaced.append
            )
            == 3
        )
        assert unpaced == []  # sleep_coef 0 (the library's default): no pause at all

    def test_sqlite_allows_one_publisher_postgres_many(
        self, repo: OutboxClients, clock: Clock
    ) -> None:
        repo.registry.register_publisher(publisher_id="first", stale_after=30)
        if repo.db.is_postgres:
            repo.registry.register_publisher(publisher_id="second", stale_after=30)
            return
        with pytest.raises(PublisherLocked, match="SQLite allows one publisher at a time"):
            repo.registry.register_publisher(publisher_id="second", stale_after=30)
        repo.registry.register_publisher(
            publisher_id="first", stale_after=30
        )  # a restart of itself is fine
        clock.advance(31)  # the first one stopped heartbeating: it is dead
        repo.registry.register_publisher(publisher_id="second", stale_after=30)

    def test_sqlite_lock_released_on_clean_stop(self, repo: OutboxClients) -> None:
        repo.registry.register_publisher(publisher_id="first", stale_after=30)
        repo.registry.unregister_publisher(publisher_id="first")
        repo.registry.register_publisher(publisher_id="second", stale_after=30)

    def test_claim_after_lease_theft_guard_on_record(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 1)
        (r,) = repo.store.claim(owner="p1", limit=1, lease_seconds=30)
        with engine.begin() as conn:  # another process took it over
            conn.execute(update(outbox).where(outbox.c.id == r.id).values(lease_owner="p2"))
        assert (
            repo.store.mark_returned(owner="p1", returns=[ReturnedRow(r.id, 312, "NO_ROUTE")]) == 0
        )
        assert row(engine, r.id)["status"] == "in_flight"

    def test_confirm_with_publish_facts_in_one_statement(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 3)
        a, b, c = repo.store.claim(owner="p1", limit=3, lease_seconds=30)
        at = T0 - dt.timedelta(milliseconds=250)
        facts = [Published(a.id, 2, 7, at), Published(b.id, 2, 8, at)]
        assert repo.store.mark_confirmed(owner="p1", published=facts, ids=[c.id]) == 3
        ra, rc = row(engine, a.id), row(engine, c.id)
        assert (ra["status"], ra["channel_id"], ra["delivery_tag"]) == ("confirmed", 2, 7)
        assert ra["published_at"] == at and ra["confirmed_at"] == T0
        assert rc["status"] == "confirmed" and rc["delivery_tag"] is None
        assert (
            repo.store.mark_confirmed(owner="p2", published=facts) == 0
        )  # guarded like every mark

    def test_unit_of_work_commits_once_or_not_at_all(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 3)
        a, b, c = repo.store.claim(owner="p1", limit=3, lease_seconds=30)
        with pytest.raises(RuntimeError), repo.db.unit_of_work():
            repo.store.mark_confirmed(owner="p1", ids=[a.id])
            repo.store.mark_failed(owner="p1", ids=[b.id], reason="x")
            raise RuntimeError("the flush died half way")
        assert statuses(engine) == {"in_flight": 3}
        with repo.db.unit_of_work():
            repo.store.mark_confirmed(owner="p1", ids=[a.id])
            repo.store.release(owner="p1", ids=[b.id, c.id], lost=True)
            assert repo.store.count_open() == 2  # reads see the unit's own writes
        assert statuses(engine) == {"confirmed": 1, "pending": 2}
        assert repo.store.count_open() == 2

    def test_write_back_values_arrive_exactly_whatever_they_hold(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        """A write-back sends its per-row values as arrays (binary on PostgreSQL, JSON on
        SQLite): a broker's reply text with quotes, commas, braces, backslashes, the word NULL or
        nothing at all, delivery tags past 32 bits, rows with and without publish facts; each
        row gets its own values, none shifted or lost."""
        texts = ['say "hi", {x} \\ y', "NULL", "", "→ ünïcode ✓", "x" * 1000]
        seed(engine, len(texts) + 1)
        *held, plain = repo.store.claim(owner="p1", limit=len(texts) + 1, lease_seconds=30)
        sent = T0 - dt.timedelta(seconds=3)
        big = 2**40
        returns = [ReturnedRow(r.id, 312, t) for r, t in zip(held, texts, strict=True)]
        facts = [Published(r.id, 7, big + i, sent) for i, r in enumerate(held[::2])]
        assert repo.store.mark_returned(owner="p1", returns=returns, published=facts) == len(texts)
        assert repo.store.record_published(owner="p1", channel_id=9, tags=[(plain.id, big)]) == 1
        for i, (r, text) in enumerate(zip(held, texts, strict=True)):
            got = row(engine, r.id)
            assert (got["status"], got["reply_text"]) == ("returned", text)
            assert got["last_error"] == f"returned by broker: 312 {text}"
            facts_of = (7, big + i // 2, sent) if i % 2 == 0 else (None, None, None)
            assert (got["channel_id"], got["delivery_tag"], got["published_at"]) == facts_of
        got = row(engine, plain.id)
        assert (got["status"], got["channel_id"], got["delivery_tag"]) == ("in_flight", 9, big)

    def test_a_broker_text_with_nul_is_kept_readable_and_settles_its_row(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        """PostgreSQL's text refuses NUL, and a broker's reply text may carry one: stored as
        U+FFFD (on both databases alike), it no longer fails the write-back it is in."""
        seed(engine, 5)
        a, b, c, d, e = repo.store.claim(owner="p1", limit=5, lease_seconds=30)
        with repo.db.unit_of_work():
            repo.store.mark_confirmed(owner="p1", ids=[e.id])
            repo.store.mark_returned(owner="p1", returns=[ReturnedRow(a.id, 312, "NO\x00ROUTE")])
            repo.store.mark_failed(owner="p1", ids=[b.id], reason="closed: 406 x\x00y")
            repo.store.retry(
                owner="p1", ids=[c.id], error="nack\x00", backoff=Backoff(), exhausted=Status.NACKED
            )
            repo.store.release(owner="p1", ids=[d.id], lost=True, error="gone\x00")
        assert row(engine, a.id)["reply_text"] == "NO\ufffdROUTE"
        assert row(engine, a.id)["last_error"] == "returned by broker: 312 NO\ufffdROUTE"
        assert row(engine, b.id)["last_error"] == "closed: 406 x\ufffdy"
        assert row(engine, c.id)["last_error"] == "nack\ufffd"
        assert row(engine, d.id)["last_error"] == "gone\ufffd"
        assert statuses(engine) == {"returned": 1, "failed": 1, "pending": 2, "confirmed": 1}

    def test_returned_and_late_tag_notes_keep_true_publish_facts(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        seed(engine, 3)
        a, b, c = repo.store.claim(owner="p1", limit=3, lease_seconds=30)
        sent = T0 - dt.timedelta(seconds=2)
        assert repo.store.record_published(
            owner="p1", channel_id=4, tags=[(c.id, 9)], published_at=sent
        )
        assert (row(engine, c.id)["delivery_tag"], row(engine, c.id)["published_at"]) == (9, sent)
        returns = [ReturnedRow(a.id, 312, "NO_ROUTE"), ReturnedRow(b.id, 313, "NO_CONSUMERS")]
        n = repo.store.mark_returned(
            owner="p1", returns=returns, published=[Published(a.id, 4, 7, sent)]
        )
        assert n == 2
        ra, rb = row(engine, a.id), row(engine, b.id)
        assert (ra["status"], ra["reply_code"], ra["delivery_tag"], ra["published_at"]) == (
            "returned",
            312,
            7,
            sent,
        )
        assert (rb["reply_text"], rb["published_at"]) == ("NO_CONSUMERS", None)
        assert rb["last_error"] == "returned by broker: 313 NO_CONSUMERS"


class TestDelayedDelivery:
    """Rows with a delivery time (``not_before``), written by the application API as production
    writes them; the repository's clock set from the real time, since the API takes the
    database's clock for rows without a delay."""

    @pytest.fixture
    def now_clock(self) -> Clock:
        clock = Clock()
        clock.now = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
        return clock

    def enqueue(self, engine: Engine, *messages: tuple[str, float | None, str | None]) -> None:
        """(message_id, delay in seconds or None, ordering key) each."""
        now = dt.datetime.now(dt.UTC)
        with Session(engine) as session, session.begin():
            enqueue(
                session,
                [
                    Message(
                        exchange="ex",
                        routing_key="rk",
                        body=b"x",
                        message_id=mid,
                        ordering_key=key,
                        not_before=None if delay is None else now + dt.timedelta(seconds=delay),
                    )
                    for mid, delay, key in messages
                ],
            )

    @staticmethod
    def claimed(repo: OutboxClients) -> list[str]:
        return [r.message_id for r in repo.store.claim(owner="p1", limit=10, lease_seconds=30)]

    def test_the_claim_skips_rows_not_due_and_takes_them_at_their_time(
        self, engine: Engine, now_clock: Clock
    ) -> None:
        repo = OutboxClients(engine, clock=now_clock)
        self.enqueue(engine, ("d60", 60, None), ("now", None, None), ("d120", 120, None))
        assert self.claimed(repo) == ["now"]
        assert self.claimed(repo) == []
        now_clock.advance(61)
        assert self.claimed(repo) == ["d60"]
        now_clock.advance(60)
        assert self.claimed(repo) == ["d120"]

    def test_a_delayed_row_holds_the_later_rows_of_its_key(
        self, engine: Engine, now_clock: Clock
    ) -> None:
        repo = OutboxClients(engine, clock=now_clock)
        self.enqueue(engine, ("k1-delayed", 60, "k"), ("k2", None, "k"), ("j1", None, "j"))
        assert self.claimed(repo) == ["j1"]  # k2 waits behind its key's delayed head
        now_clock.advance(61)
        head = repo.store.claim(owner="p1", limit=10, lease_seconds=30)
        assert [r.message_id for r in head] == ["k1-delayed"]
        assert self.claimed(repo) == []
        repo.store.mark_confirmed(owner="p1", ids=[head[0].id])
        assert self.claimed(repo) == ["k2"]

    def test_operators_see_delayed_rows_apart_from_late_ones(
        self, engine: Engine, now_clock: Clock
    ) -> None:
        self.enqueue(engine, ("later", 3600, None), ("due", None, None))
        stats = read_stats(
            engine,
            now=now_clock.now + dt.timedelta(seconds=20),
            alive_after=30,
            latency_window=dt.timedelta(minutes=5),
            latency_rows=100,
        )
        assert stats.counts[Status.PENDING] == 2 and stats.delayed == 1
        assert stats.next_delayed_at is not None
        assert 3500 < (stats.next_delayed_at - stats.at).total_seconds() < 3600
        assert stats.oldest_pending_age_seconds is not None
        assert 19 < stats.oldest_pending_age_seconds < 30  # "due", not the delayed row
        assert verdict(stats).reasons[0] == "1 rows waiting and no publisher alive"
        # what `outbox status` prints and GET /v1/stats returns, from these figures
        assert "delayed (not due yet) 1, next due in 59m" in render_stats(stats)
        shown = StatsOut.of(stats)
        assert shown.delayed == 1 and shown.next_delayed_at == stats.next_delayed_at
        repo = OutboxClients(engine, clock=now_clock)
        due = repo.store.claim(owner="p1", limit=10, lease_seconds=30)
        repo.store.mark_confirmed(owner="p1", ids=[r.id for r in due])
        # an hour and a minute on, the delayed row is late by a minute, not by its whole life
        late = read_stats(
            engine,
            now=now_clock.now + dt.timedelta(seconds=3660),
            alive_after=30,
            latency_window=dt.timedelta(minutes=5),
            latency_rows=100,
        )
        assert late.delayed == 0 and late.next_delayed_at is None
        assert late.oldest_pending_age_seconds is not None
        assert 55 < late.oldest_pending_age_seconds < 70, late.oldest_pending_age_seconds
        snap = metrics_snapshot(engine, now=now_clock.now, alive_after=30)
        assert snap.delayed == 1


def test_published_again_names_the_confirmed_rows_others_hold_or_will_publish(
    repo: OutboxClients, engine: Engine, clock: Clock
) -> None:
    """Issue 49: a confirm this publisher could not write (the row no longer held) is a possible
    duplicate unless the row stands confirmed by this very publish (its own earlier write-back,
    whose COMMIT reply was lost)."""
    seed(engine, 4)
    mine, swept, taken, other = (
        r.id for r in repo.store.claim(owner="p1", limit=4, lease_seconds=60)
    )
    at = clock.now
    facts = [Published(i, 1, n + 1, at) for n, i in enumerate((mine, swept, taken, other))]
    assert repo.store.mark_confirmed(owner="p1", published=[facts[0]]) == 1  # its own, earlier
    clock.advance(120)  # p1 paused past its lease: the sweep puts the rest back
    assert repo.store.release_expired() == 3
    clock.advance(1)
    again = repo.store.claim(owner="p2", limit=3, lease_seconds=60)  # and publishes them again
    later = [Published(r.id, 7, n + 1, clock.now) for n, r in enumerate(again) if r.id != swept]
    repo.store.release(owner="p2", ids=[swept], lost=False, error="stopped")  # back to pending
    assert repo.store.mark_confirmed(owner="p2", published=later) == 2
    # p1 now writes the confirms it got for all four: none is held by it any more
    assert repo.store.mark_confirmed(owner="p1", published=facts) == 0
    assert repo.store.published_again(facts) == sorted([swept, taken, other])
    assert repo.store.published_again([]) == []


def test_a_row_named_twice_counts_two_publishes_held_or_not(
    repo: OutboxClients, engine: Engine
) -> None:
    """Issue 49 (the generator's finding): two resends of one row in one write-back (after the
    first write-back failed) grew ``lost_confirms`` by one. Each is a publish of its own, and
    ``count_again`` counts a row it is told of twice twice, whoever holds it, with one event."""
    seed(engine, 2)
    a, b = (r.id for r in repo.store.claim(owner="p1", limit=2, lease_seconds=60))
    assert repo.store.resend(owner="p1", ids=[a, a, b], error="channel closed") == 2
    assert (row(engine, a)["lost_confirms"], row(engine, a)["attempts"]) == (2, 3)
    assert (row(engine, b)["lost_confirms"], row(engine, b)["attempts"]) == (1, 2)
    assert repo.store.held_ids(owner="p1", ids=[a, b]) == {a, b}
    assert repo.store.held_ids(owner="p2", ids=[a, b]) == set()
    assert repo.store.count_again([b, b, a], error="a failover undid it") == 3
    assert (row(engine, a)["lost_confirms"], row(engine, b)["lost_confirms"]) == (3, 3)
    assert row(engine, b)["last_error"] == "a failover undid it"
    assert row(engine, a)["status"] == "in_flight"  # counted, not moved


def test_after_a_failover_rows_are_found_by_message_id(
    repo: OutboxClients, engine: Engine, clock: Clock
) -> None:
    """Issue 49: a failover to a standby behind the primary can undo a row's insert and hand
    its id to another message. The check after the outage finds each confirmed row by its
    message id: written again where it is pending (under whatever id), counted where another
    publish confirmed it, and named when it is gone."""
    seed(engine, 3)
    rows = repo.store.claim(owner="p1", limit=3, lease_seconds=60)
    facts = [Published(r.id, 1, n + 1, clock.now) for n, r in enumerate(rows)]
    messages = {r.id: r.message_id for r in rows}
    back, other, gone = rows
    with engine.begin() as conn:  # what the new primary has: back pending, other confirmed by
        conn.execute(  # another publish, gone's insert undone and its id handed to a new message
            update(outbox)
            .where(outbox.c.id == back.id)
            .values(status="pending", lease_owner=None, lease_until=None)
        )
        conn.execute(
            update(outbox)
            .where(outbox.c.id == other.id)
            .values(status="confirmed", published_at=clock.now + dt.timedelta(seconds=5))
        )
        conn.execute(
            update(outbox)
            .where(outbox.c.id == gone.id)
            .values(message_id="someone-else", status="pending", lease_owner=None)
        )
    assert repo.store.confirm_again(owner="p1", published=facts, messages=messages) == [back.id]
    assert row(engine, back.id)["status"] == "confirmed"
    assert row(engine, gone.id)["status"] == "pending"  # the other message: left alone
    again, vanished = repo.store.recheck(facts, messages)
    assert again == [other.id] and vanished == [gone.message_id]
