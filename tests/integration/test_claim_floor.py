"""The unkeyed claim goes on from the last row it took (its floor), not from the start of
``ix_outbox_due``, and walks from the start once per ``CLAIM_REWALK`` for the rows that land
behind the floor: a late commit, rows another claim held locked, a held batch released.

Why: every row claimed since the last VACUUM leaves an entry in ``ix_outbox_due`` that a walk
from the start steps over, so the claim's cost grew with the traffic between two vacuums. The
last test shows the difference in the buffers the walk reads. PostgreSQL only (SQLite removes
index entries at once, and there the claim walks from the start as before).
"""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, event, insert, text
from sqlalchemy.exc import DBAPIError

from app.outbox.planner import CLAIM_REWALK
from app.outbox.schema import held
from tests.support.large_outbox import captured, plan_nodes
from tests.support.outbox_clients import OutboxClients

pytestmark = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)

T0 = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def add(engine: Engine, names: list[str], *, at: dt.datetime, batch: str = "b:1") -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, "
                "available_at) SELECT m, :batch, 'ex', 'rk', '\\x00'::bytea, :at "
                "FROM unnest(CAST(:names AS text[])) AS m"
            ),
            {"names": names, "at": at, "batch": batch},
        )


def claim(repo: OutboxClients, n: int) -> list[str]:
    return [r.message_id for r in repo.store.claim(owner="p1", limit=n, lease_seconds=60)]


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def test_a_late_commit_behind_the_floor_waits_for_the_next_walk_from_the_start(
    engine: Engine,
) -> None:
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    add(engine, names("a", 10), at=T0 - dt.timedelta(seconds=10))
    assert claim(repo, 4) == names("a", 4)  # from the start: there is no floor yet
    # a transaction that began before those rows commits now: its rows sort before the floor
    add(engine, ["late"], at=T0 - dt.timedelta(seconds=60))
    clock.advance(0.5)
    assert claim(repo, 100) == names("a", 10)[4:]  # from the floor: the late row is behind it
    assert claim(repo, 100) == []
    clock.advance(CLAIM_REWALK.total_seconds())
    assert claim(repo, 100) == ["late"]  # the walk from the start finds it


def test_rows_another_claim_held_locked_are_taken_on_the_next_walk_from_the_start(
    engine: Engine,
) -> None:
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    add(engine, names("r", 8), at=T0 - dt.timedelta(seconds=10))
    with engine.connect() as other:  # another publisher's claim, still running: r002 locked
        other.execute(text("SELECT id FROM outbox WHERE message_id = 'r002' FOR UPDATE"))
        assert claim(repo, 4) == ["r000", "r001", "r003", "r004"]  # SKIP LOCKED
        other.rollback()  # that claim failed: r002 is pending, behind the floor
    clock.advance(0.2)
    assert claim(repo, 100) == ["r005", "r006", "r007"]
    clock.advance(CLAIM_REWALK.total_seconds())
    assert claim(repo, 100) == ["r002"]


def test_a_held_batch_released_behind_the_floor_is_claimed_after_the_next_walk(
    engine: Engine,
) -> None:
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    with engine.begin() as conn:
        conn.execute(insert(held).values(batch_id="spark:1"))
    add(engine, names("h", 3), at=T0 - dt.timedelta(seconds=30), batch="spark:1")
    add(engine, names("n", 3), at=T0 - dt.timedelta(seconds=10))
    assert claim(repo, 100) == names("n", 3)  # the held batch's rows are skipped
    with engine.begin() as conn:  # every partition succeeded: the batch is released
        conn.execute(held.delete().where(held.c.batch_id == "spark:1"))
    clock.advance(0.1)
    assert claim(repo, 100) == []
    clock.advance(CLAIM_REWALK.total_seconds())
    assert claim(repo, 100) == names("h", 3)


def test_keyed_rows_are_claimed_as_key_heads_whatever_the_floor(engine: Engine) -> None:
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    add(engine, names("u", 3), at=T0 - dt.timedelta(seconds=5))
    assert claim(repo, 3) == names("u", 3)
    with engine.begin() as conn:  # keyed rows older than the floor
        conn.execute(
            text(
                "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, "
                "ordering_key, available_at) VALUES ('k0', 'b', 'ex', 'rk', '', 'key', :at), "
                "('k1', 'b', 'ex', 'rk', '', 'key', :at)"
            ),
            {"at": T0 - dt.timedelta(seconds=60)},
        )
    clock.advance(0.1)
    assert claim(repo, 100) == ["k0"]  # the head of its key, found by the keyed claim


def _index_buffers(engine: Engine, sent: list[tuple[str, Any]]) -> int:
    """Buffers the claim's walk of ix_outbox_due reads, explained in the claim's transaction
    (with its settings) and rolled back. The second reading: the first visit of an entry whose
    row changed also reads the row and marks the entry dead (then later walks only step over
    it), as every walk does once for the rows the previous claim took."""
    claim_sql, params = next((s, p) for s, p in sent if s.lstrip().upper().startswith("WITH"))
    buffers = 0
    for _ in range(2):
        with engine.begin() as conn:
            for statement, values in sent:
                if "set_config" in statement:
                    conn.exec_driver_sql(statement, values)
            plan = conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {claim_sql}", params
            ).scalar()
            conn.rollback()
        (walk,) = [n for n in plan_nodes(plan[0]["Plan"]) if n.get("Index Name") == "ix_outbox_due"]
        buffers = int(walk["Shared Hit Blocks"]) + int(walk["Shared Read Blocks"])
    return buffers


def test_the_walk_from_the_floor_skips_the_entries_of_rows_claimed_since_the_last_vacuum(
    engine: Engine,
) -> None:
    """30,000 rows claimed and confirmed with autovacuum off (their entries stay in
    ix_outbox_due), then 200 new ones: the claim from the floor reads a few buffers, a walk
    from the start every page of the dead entries (here 3 against 117)."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE outbox SET (autovacuum_enabled = false)"))
        conn.execute(
            text(
                "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, "
                "available_at) SELECT 'old-' || g, 'b', 'ex', 'rk', '\\x00'::bytea, "
                ":t0 - make_interval(secs => 40000 - g) FROM generate_series(1, 30000) g"
            ),
            {"t0": T0},
        )
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    for _ in range(15):
        assert len(claim(repo, 2000)) == 2000
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'confirmed' WHERE status = 'in_flight'"))
    add(engine, names("new", 200), at=T0)
    clock.advance(0.1)
    floored, sent_floored = captured(engine, lambda: claim(repo, 100))
    assert floored == names("new", 100)
    clock.advance(CLAIM_REWALK.total_seconds())
    started, sent_start = captured(engine, lambda: claim(repo, 100))
    assert started == names("new", 200)[100:]
    from_floor, from_start = (
        _index_buffers(engine, sent_floored),
        _index_buffers(engine, sent_start),
    )
    assert from_floor * 10 < from_start, (from_floor, from_start)


def test_rows_released_at_the_floors_own_time_are_claimed_at_once(engine: Engine) -> None:
    """A release sets ``available_at`` to now, which can equal the floor's (a coarse or a test
    clock): the row sorts behind the floor by its id. The release makes the next claim walk
    from the start, once its transaction committed; so does the sweep of expired leases."""
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    add(engine, names("s", 3), at=T0)
    got = repo.store.claim(owner="p1", limit=3, lease_seconds=60)
    with repo.db.unit_of_work():  # as the write-back does: the walk waits for the commit
        repo.store.release(owner="p1", ids=[got[0].id], lost=True, error="channel closed")
        assert not repo.store._floor._rewalk
    assert repo.store._floor._rewalk
    assert claim(repo, 10) == ["s000"]
    assert repo.store.mark_confirmed(owner="p1", ids=[got[0].id]) == 1
    clock.advance(120)  # the other two rows' lease runs out
    assert repo.store.release_expired() == 2
    assert claim(repo, 10) == ["s001", "s002"]


def test_a_claim_whose_transaction_never_commits_leaves_no_row_behind_the_floor(
    engine: Engine,
) -> None:
    """The server ends the claim's session after its unkeyed claim ran (as it does for a claim
    idle in its transaction past its limit: a CI run on two busy cores saw it): the rows it
    took roll back, and the next claim takes them at once, not after ``CLAIM_REWALK``. Before,
    the floor had moved past them and the next claim found 1 row of 2,000."""
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    add(engine, names("r", 50), at=T0 - dt.timedelta(seconds=10))
    _claim_in_a_session_the_server_ends(engine, repo, 20)
    assert claim(repo, 20) == names("r", 20)  # at once, from the start
    assert claim(repo, 100) == names("r", 50)[20:]


# ---------------------------------------------------------------- generated schedules


STEPS = st.one_of(
    st.tuples(st.just("write"), st.integers(1, 6), st.sampled_from([0.0, 0.0, 0.5, 3.0])),
    st.tuples(st.just("claim"), st.integers(1, 8), st.just(0.0)),
    st.tuples(st.just("claim_fails"), st.integers(1, 8), st.just(0.0)),
    st.tuples(st.just("confirm"), st.integers(1, 4), st.just(0.0)),
    st.tuples(st.just("release"), st.integers(1, 4), st.sampled_from([0.0, 0.0, 2.0])),
    # around the rewalk's period (1 s): a walk from the start comes with some claims only
    st.tuples(st.just("advance"), st.just(0), st.sampled_from([0.0, 0.1, 0.6, 1.5])),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEPS, min_size=1, max_size=30))
# the rows a failed claim took, due again at once: a floor left past them waits for the rewalk
@example(steps=[("write", 4, 0.0), ("claim_fails", 2, 0.0), ("claim", 8, 0.0)])
# rows released at the floor's own time, one below it: the release makes a walk from the start
@example(steps=[("write", 4, 0.0), ("claim", 4, 0.0), ("release", 2, 0.0), ("claim", 8, 0.0)])
def test_every_claim_takes_the_first_due_rows_whatever_failed_before(
    engine: Engine, steps: list[tuple[str, int, float]]
) -> None:
    """With every row committed as it is written (no late commit, no held batch: the cases
    that wait for the rewalk by design), each claim takes exactly the first ``limit`` due
    pending rows in ``(available_at, id)`` order, whatever came before it: claims whose
    session the server ended after their statement ran (their rows roll back), rows released
    back to pending (due now or later), confirms, and time passing around the rewalk's
    period. The model is that order, nothing of the floor; the floor only must not change
    what a claim takes."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox, outbox_events RESTART IDENTITY"))
    clock = Clock()
    repo = OutboxClients(engine, clock=clock)
    due: dict[int, dt.datetime] = {}  # pending rows: id -> available_at
    held_rows: list[int] = []  # in flight, claim order
    written = itertools.count()
    for kind, n, seconds in steps:
        if kind == "write":
            at = clock.now + dt.timedelta(seconds=seconds)
            made = [f"w{next(written):04d}" for _ in range(n)]
            add(engine, made, at=at)
            with engine.connect() as conn:
                ids = conn.execute(
                    text("SELECT id FROM outbox WHERE message_id = ANY(:m)"), {"m": made}
                ).scalars()
                due.update((i, at) for i in ids)
        elif kind in ("claim", "claim_fails"):
            expect = sorted((at, i) for i, at in due.items() if at <= clock.now)[:n]
            if kind == "claim_fails":
                _claim_in_a_session_the_server_ends(engine, repo, n)
                continue
            got = repo.store.claim(owner="p1", limit=n, lease_seconds=60)
            assert sorted(r.id for r in got) == sorted(i for _, i in expect), (expect, due)
            for r in got:
                del due[r.id]
            held_rows += [r.id for r in got]
        elif kind == "confirm" and held_rows:
            done, held_rows = held_rows[:n], held_rows[n:]
            assert repo.store.mark_confirmed(owner="p1", ids=done) == len(done)
        elif kind == "release" and held_rows:
            back, held_rows = held_rows[-n:], held_rows[:-n]
            assert repo.store.release(owner="p1", ids=back, lost=False, delay=seconds) == len(back)
            due.update((i, clock.now + dt.timedelta(seconds=seconds)) for i in back)
        elif kind == "advance":
            clock.advance(seconds)


def _claim_in_a_session_the_server_ends(engine: Engine, repo: OutboxClients, n: int) -> None:
    """A claim whose session the server ends once its claim statement ran: it raises, and
    every row it took rolls back."""
    ended: list[int] = []

    def end_session(conn: Any, _cursor: Any, _sql: str, params: Any, *_: Any) -> None:
        if not ended and isinstance(params, dict) and "claim_limit" in params:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            with engine.connect() as other:
                other.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            ended.append(pid)

    event.listen(engine, "after_cursor_execute", end_session)
    try:
        with pytest.raises(DBAPIError):
            repo.store.claim(owner="p1", limit=n, lease_seconds=60)
    finally:
        event.remove(engine, "after_cursor_execute", end_session)
    assert ended, "the claim statement never ran"
