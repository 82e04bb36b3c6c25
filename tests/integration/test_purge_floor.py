"""``outbox purge --every`` starts most passes at the last walk's floor instead of the table's
first row, so old failed, returned or skipped rows are not read again every few seconds.

The rule: after every pass that succeeded, no row past retention is left, whatever was written,
confirmed, failed, republished and confirmed later, and however time moved between passes. It
holds because a row below the floor was not confirmed when a walk passed it (so it is not past
retention before ``older_than`` after that walk), and a whole walk comes at least every half
retention. Tested over generated schedules (Hypothesis) on SQLite, against a plain model of
which rows are past retention; the floor itself on PostgreSQL and SQLite.
"""

from __future__ import annotations

import datetime as dt
import itertools
import shutil
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from app.db import make_engine
from app.outbox.purging import PurgeLoop, PurgeSchedule
from app.outbox.schema import outbox
from app.outbox.scope import RepublishFilter
from app.outbox.states import Status
from tests.support.clock import Clock
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

OLDER_THAN = dt.timedelta(seconds=100)


def _rows(engine: Engine) -> dict[int, tuple[str, dt.datetime | None]]:
    with engine.connect() as conn:
        found = conn.execute(select(outbox.c.id, outbox.c.status, outbox.c.confirmed_at))
        return {r.id: (r.status, r.confirmed_at) for r in found}


def _past_retention(rows: dict[int, tuple[str, dt.datetime | None]], now: dt.datetime) -> set[int]:
    cutoff = now - OLDER_THAN
    return {i for i, (status, at) in rows.items() if status == "confirmed" and at and at < cutoff}


def _settle(repo: OutboxClients, engine: Engine, n: int, *, outcome: str) -> list[int]:
    now = repo.db.clock()
    add_rows(engine, n=n, created_at=now, available_at=now)
    ids = [r.id for r in repo.store.claim(owner="p", limit=n, lease_seconds=60)]
    if outcome == "confirmed":
        repo.store.mark_confirmed(owner="p", ids=ids)
    elif outcome == "failed":
        repo.store.mark_failed(owner="p", ids=ids, reason="a test's failure")
    return ids


def _loop(repo: OutboxClients, clock: Clock, *, chunk: int) -> PurgeLoop:
    schedule = PurgeSchedule(
        older_than=OLDER_THAN,
        inbox_older_than=OLDER_THAN,
        every=5.0,
        audit_every=3600.0,
        chunk=chunk,
        sleep_coef=0.0,
        actor="retention",
    )

    def failed(why: str) -> None:
        raise AssertionError(why)

    return PurgeLoop(
        repo.retention,
        schedule,
        inbox=lambda _older, _chunk: 0,
        on_audit=lambda _doc: None,
        on_failure=failed,
        clock=lambda: clock.now.timestamp(),
        wall=lambda: clock.now.timestamp(),
    )


def test_a_walk_stops_its_floor_at_the_first_row_confirmed_within_retention(db_url: str) -> None:
    clock = Clock()
    engine = make_engine(db_url)
    try:
        repo = OutboxClients(engine, clock=clock)
        failed = _settle(repo, engine, 40, outcome="failed")
        old = _settle(repo, engine, 30, outcome="confirmed")
        clock.advance(150)  # those 30 are past retention
        waiting = _settle(repo, engine, 10, outcome="pending")  # claimed, in flight
        recent = _settle(repo, engine, 20, outcome="confirmed")
        _settle(repo, engine, 5, outcome="failed")

        # the walk ends with the first window holding nothing to delete, all written after the
        # cutoff (ids 71-77 of 7-row windows); its floor stops at the first row written after
        # the cutoff (it may yet be confirmed with a time from before the walk)
        walked = repo.retention.walk(older_than=OLDER_THAN, chunk=7)
        assert (walked.deleted, walked.read, walked.floor) == (30, 77, old[-1])
        assert old[-1] < waiting[0] < recent[0]
        assert set(_rows(engine)).isdisjoint(old) and set(failed) <= set(_rows(engine))
        # from the floor on: the 40 old failed rows are not read again
        again = repo.retention.walk(older_than=OLDER_THAN, chunk=7, start_after=walked.floor)
        assert (again.deleted, again.read, again.floor) == (0, 7, old[-1])
    finally:
        engine.dispose()


def test_the_loop_reads_old_failed_rows_once_per_whole_walk(sqlite_url: str) -> None:
    clock = Clock()
    engine = make_engine(sqlite_url)
    try:
        repo = OutboxClients(engine, clock=clock)
        _settle(repo, engine, 300, outcome="failed")
        clock.advance(150)  # past retention: a whole walk reads them all
        loop = _loop(repo, clock, chunk=50)
        reads = []
        for _ in range(12):  # 60 s: one whole walk, then 11 from the floor (due every 50 s)
            _settle(repo, engine, 10, outcome="confirmed")
            before = loop.total.read
            loop._pass()
            reads.append(loop.total.read - before)
            clock.advance(5)
        assert loop.total.full_walks == 2, reads  # at 0 s and at 50 s
        assert reads[0] >= 300 and reads[10] >= 300
        assert all(r < 300 for i, r in enumerate(reads) if i not in (0, 10)), reads
    finally:
        engine.dispose()


STEPS = st.one_of(
    st.tuples(st.just("write"), st.integers(1, 12)),
    st.tuples(st.just("confirm"), st.integers(1, 12)),
    st.tuples(st.just("fail"), st.integers(1, 6)),
    st.tuples(st.just("republish"), st.just(0)),
    # around the rule's own periods: a whole walk every 50 s, a retention of 100 s
    st.tuples(st.just("advance"), st.sampled_from([1, 5, 20, 45, 55, 101])),
    st.tuples(st.just("pass"), st.just(0)),
    st.tuples(st.just("pass"), st.just(0)),
)
_copies = itertools.count()


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEPS, min_size=1, max_size=40), chunk=st.integers(1, 8))
# a row written long before it was confirmed (not fresh when a walk passes it, confirmed within
# retention): a floor that passed it would leave it past retention until the next whole walk
@example(
    steps=[
        ("write", 1),
        ("advance", 101),
        ("confirm", 1),
        ("pass", 0),  # a whole walk at 101
        ("advance", 55),
        ("pass", 0),  # a whole walk at 156: its floor must stop at the row
        ("advance", 45),
        ("advance", 1),
        ("pass", 0),  # from the floor at 202: the row is past retention (confirmed at 101)
    ],
    chunk=1,
)
def test_no_row_past_retention_outlives_a_pass(
    steps: list[tuple[str, int]], chunk: int, sqlite_template: Path, tmp_path: Path
) -> None:
    path = tmp_path / f"outbox-{next(_copies)}.db"
    shutil.copyfile(sqlite_template, path)
    clock = Clock()
    engine = make_engine(f"sqlite:///{path}")
    try:
        repo = OutboxClients(engine, clock=clock)
        loop = _loop(repo, clock, chunk=chunk)
        whole_walk_at = clock.now
        for step, n in [*steps, ("pass", 0)]:
            if step == "write":
                add_rows(engine, n=n, created_at=clock.now, available_at=clock.now)
            elif step in ("confirm", "fail"):
                ids = [r.id for r in repo.store.claim(owner="p", limit=n, lease_seconds=600)]
                if step == "confirm":
                    repo.store.mark_confirmed(owner="p", ids=ids)
                else:
                    repo.store.mark_failed(owner="p", ids=ids, reason="generated")
            elif step == "republish":
                flt = RepublishFilter(statuses=frozenset({Status.FAILED}))
                repo.actions.republish(actor="op", filter=flt, limit=1000, dry_run=False)
            elif step == "advance":
                clock.advance(n)
            else:
                before = _rows(engine)
                doomed = _past_retention(before, clock.now)
                walks = loop.total.full_walks
                loop._pass()
                after = _rows(engine)
                assert set(before) - set(after) == doomed, "deleted exactly the rows past retention"
                assert not _past_retention(after, clock.now)
                if loop.total.full_walks > walks:
                    whole_walk_at = clock.now
                # the lemma: a row below the floor was not confirmed when a walk since the last
                # whole one passed it
                assert all(
                    at is not None and at >= whole_walk_at
                    for i, (status, at) in after.items()
                    if i <= loop.floor and status == "confirmed"
                ), (loop.floor, after)
    finally:
        engine.dispose()
