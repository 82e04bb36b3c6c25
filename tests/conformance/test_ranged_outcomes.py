"""The publisher's store settling by ranges (app/outbox/ranged.py) over generated schedules of
outcomes, against a model of what each row's status must be.

Steps, on a migrated PostgreSQL outbox: producers write rows; the publisher claims (its row
path's rows and ranges, in one transaction) and writes its outcomes as the write-back does, a
few kinds in one unit of work (a confirm, a nack, a return, a failure, a release, a lost
confirm, a resend, a postponement); a write-back that fails before its commit (its unit of
work rolled back: the store's memory of what ranges owe must roll back with it, and the same
outcomes are written again later, as the write-back retries); and another publisher's sweep
once every lease has run out (the ranges expire, their members handed back).

The model knows nothing of ranges: each held row is settled by the outcome written on it, a
range's member confirmed once all the rows its claim took are confirmed or taken by another
outcome. Checked after every step, for every row: the status a reader derives
(``RangeStore.statuses``) and ``lost_confirms`` equal the model's; every publish after a row's
first is counted in its ``lost_confirms``; no range stays leased once it owes nothing.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.db import make_engine
from app.outbox.ranged import RangedPublisherStore
from app.outbox.records import Backoff, ReturnedRow
from app.outbox.states import Status
from tests.support.env import copy_database, database_url, drop_database

OWNER = "publisher-1"
INSERT = (
    "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, ordering_key) "
    "SELECT 'm-' || %(tag)s || '-' || g, 'b', 'ex', 'rk', '\\x7b7d', %(key)s "
    "FROM generate_series(1, %(n)s) g"
)
#: Outcomes other than a confirm, and what each leaves on the row (status, lost confirms added,
#: still held by the publisher).
EXCEPTIONS = {
    "nack": ("pending", 0, False),
    "return": ("returned", 0, False),
    "fail": ("failed", 0, False),
    "release": ("pending", 0, False),
    "lost": ("pending", 1, False),
    "postpone": ("pending", 0, False),
    "resend": ("in_flight", 1, True),
}


class Boom(Exception):
    """A write-back failing before its commit."""


@dataclass
class Model:
    status: dict[int, str] = field(default_factory=dict)  # every row -> status a reader sees
    lost: dict[int, int] = field(default_factory=dict)
    publishes: dict[int, int] = field(default_factory=dict)
    held: set[int] = field(default_factory=set)  # rows the publisher holds
    #: rows a range claim took -> the range's other rows; a member shows in_flight until each
    #: row its claim took is settled, then confirmed if it was confirmed
    claim_of: dict[int, frozenset[int]] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)  # range members confirmed, range not settled
    tags: int = 0


class World:
    def __init__(self, url: str) -> None:
        self.url = url
        self.admin = psycopg.connect("postgresql://" + url.split("://", 1)[1], autocommit=True)
        self.engine = make_engine(url)
        self.store = RangedPublisherStore(self.engine)
        self.sweeper = RangedPublisherStore(self.engine)

    def reset(self) -> None:
        self.admin.execute("TRUNCATE outbox, outbox_ranges, outbox_held RESTART IDENTITY")
        self.admin.execute("UPDATE outbox_range_cursor SET xid = '0', id = 0")
        self.store = RangedPublisherStore(self.engine)

    def close(self) -> None:
        self.admin.close()
        self.engine.dispose()


@pytest.fixture(scope="module")
def world(service_urls: dict[str, str], pg_template: str) -> Iterator[World]:
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = copy_database(admin, template=pg_template, prefix="outbox_ro_")
    made = World(database_url(service_urls, name))
    try:
        yield made
    finally:
        made.close()
        drop_database(admin, name)
        admin.dispose()


def _pick(model: Model, who: int, k: int) -> list[int]:
    held = sorted(model.held)
    if not held:
        return []
    rng = random.Random(who)
    return rng.sample(held, min(k, len(held)))


def _settle_ranges(m: Model) -> None:
    """A range whose rows are all settled by their own outcome or acked: its acked members
    confirmed (a reader derives it from the range, settled)."""
    for row in list(m.acked):
        if row not in m.acked:
            continue
        rows = m.claim_of[row]
        if all(r in m.acked or m.claim_of.get(r) != rows for r in rows):
            for r in rows & m.acked:
                m.status[r] = "confirmed"
                m.acked.discard(r)
                del m.claim_of[r]


def _write_back(w: World, m: Model, kinds: list[tuple[str, list[int]]], *, fail: bool) -> None:
    """One write-back: the outcomes in one unit of work (the write-back's settings), resends
    first as the write-back orders them; ``fail``: it raises before its commit."""
    db = w.store.db
    backoff = Backoff(base=30.0, cap=60.0, rng=random.Random(0))
    kinds = sorted(kinds, key=lambda kv: kv[0] != "resend")
    try:
        with db.unit_of_work(durable=False, by_id=True, positions=True):
            for kind, ids in kinds:
                if kind == "confirm":
                    w.store.mark_confirmed(owner=OWNER, ids=ids)
                elif kind == "nack":
                    w.store.retry(
                        owner=OWNER,
                        ids=ids,
                        error="nacked",
                        backoff=backoff,
                        exhausted=Status.NACKED,
                        nack=True,
                    )
                elif kind == "return":
                    returns = [ReturnedRow(i, 312, "NO_ROUTE") for i in ids]
                    w.store.mark_returned(owner=OWNER, returns=returns)
                elif kind == "fail":
                    w.store.mark_failed(owner=OWNER, ids=ids, reason="too big")
                elif kind in ("release", "lost"):
                    w.store.release(owner=OWNER, ids=ids, lost=kind == "lost", error=kind)
                elif kind == "postpone":
                    w.store.postpone(owner=OWNER, ids=ids, error="outage", delay=30.0)
                else:
                    w.store.resend(owner=OWNER, ids=ids, error="isolated")
            if fail:
                raise Boom
    except Boom:
        return
    for kind, ids in kinds:
        for row in ids:
            if kind == "confirm":
                if row in m.claim_of:
                    m.acked.add(row)
                else:
                    m.status[row] = "confirmed"
                m.held.discard(row)
            else:
                status, lost, still = EXCEPTIONS[kind]
                m.status[row] = status
                m.lost[row] += lost
                m.claim_of.pop(row, None)
                if still:  # published again (isolated): a new publish, counted
                    m.publishes[row] += 1
                else:
                    m.held.discard(row)
                if not lost:  # that publish delivered nothing (nacked, returned, never sent)
                    m.publishes[row] -= 1
    _settle_ranges(m)


def _step(w: World, m: Model, step: tuple[str, int, int]) -> None:
    kind, who, n = step
    if kind in ("write", "write_keyed"):
        m.tags += 1
        key = f"k{who}" if kind == "write_keyed" else None
        ids = w.admin.execute(
            INSERT + " RETURNING id", {"tag": m.tags, "key": key, "n": n}
        ).fetchall()
        for (row,) in ids:
            m.status[row] = "pending"
            m.lost[row] = 0
            m.publishes[row] = 0
    elif kind == "claim":
        rows = w.store.claim(owner=OWNER, limit=n, lease_seconds=3600)
        members = w.store.range_members(r.id for r in rows)
        by_range: dict[int, set[int]] = {}
        for row in rows:
            assert m.status[row.id] == "pending", f"row {row.id} claimed while {m.status[row.id]}"
            m.status[row.id] = "in_flight"
            m.publishes[row.id] += 1
            m.held.add(row.id)
            m.claim_of.pop(row.id, None)
            if row.id in members:
                by_range.setdefault(w.store.range_of(row.id), set()).add(row.id)
        for ids in by_range.values():
            for row in ids:
                m.claim_of[row] = frozenset(ids)
    elif kind == "expire":  # the publisher stalled: another's sweep once its leases ran out
        w.admin.execute(
            "UPDATE outbox_ranges SET lease_until = now() - interval '1 s' WHERE settled_at IS NULL"
        )
        w.admin.execute(
            "UPDATE outbox SET lease_until = now() - interval '1 s' WHERE status = 'in_flight'"
        )
        w.sweeper.release_expired()
        for row in sorted(m.held):  # every held row: pending again, a possible duplicate
            m.status[row] = "pending"
            m.lost[row] += 1
            m.claim_of.pop(row, None)
            m.acked.discard(row)
        for row in list(m.acked):  # acked, range never settled: handed back too
            m.status[row] = "pending"
            m.lost[row] += 1
            m.claim_of.pop(row, None)
        m.acked.clear()
        m.held.clear()  # the stalled publisher resumes, its leases gone: its claims go on
    else:
        chosen = _pick(m, who, n)
        if not chosen:
            return
        half = max(1, len(chosen) // 2)
        other = ("nack", "return", "fail", "release", "lost", "postpone", "resend")[who % 7]
        kinds = [("confirm", chosen[:half])]
        if chosen[half:]:
            kinds.append((other, chosen[half:]))
        if kind == "confirm_all":
            kinds = [("confirm", chosen)]
        _write_back(w, m, kinds, fail=kind == "writeback_fails")


def _check(w: World, m: Model) -> None:
    derived = w.store.ranges.statuses(sorted(m.status))
    assert derived == m.status, "a derived status differs from the model"
    with w.engine.connect() as conn:
        lost = dict(conn.exec_driver_sql("SELECT id, lost_confirms FROM outbox").all())
    assert lost == m.lost, "lost_confirms differ from the model"
    for row, times in m.publishes.items():
        assert times - 1 <= lost[row], f"row {row} published {times} times, {lost[row]} counted"
    owing = w.admin.execute(
        "SELECT count(*) FROM outbox_ranges WHERE settled_at IS NULL AND owner IS NOT NULL "
        "AND NOT (range_id = ANY(%s))",
        (list(w.store.owed),),
    ).fetchone()
    assert owing == (0,), "a range leased with nothing owed in memory"


KINDS = [
    *["write"] * 2,
    "write_keyed",
    *["claim"] * 3,
    *["confirm_all"] * 2,
    *["outcomes"] * 3,
    "writeback_fails",
    "expire",
]
STEPS = st.tuples(st.sampled_from(KINDS), st.integers(0, 13), st.integers(1, 8))


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEPS, max_size=30))
# a failed write-back, then the same rows' outcomes written again
@example(
    steps=[
        ("write", 0, 6),
        ("claim", 0, 6),
        ("writeback_fails", 1, 6),
        ("confirm_all", 2, 8),
        ("confirm_all", 3, 8),
    ]
)
# one range of two rows: one confirmed, the other returned in the same write-back: settled
@example(steps=[("write", 0, 2), ("claim", 0, 2), ("outcomes", 1, 2)])
# a release of a member (its publish never sent) beside a confirm
@example(steps=[("write", 0, 2), ("claim", 0, 2), ("outcomes", 3, 2)])
# a resend and a confirm of one range's rows in one write-back
@example(steps=[("write", 0, 4), ("claim", 0, 4), ("outcomes", 6, 4), ("confirm_all", 0, 8)])
# the leases run out with a range half acked: handed back, claimed again on the row path
@example(
    steps=[
        ("write", 0, 4),
        ("claim", 0, 4),
        ("confirm_all", 1, 2),
        ("expire", 0, 0),
        ("claim", 0, 8),
        ("confirm_all", 2, 8),
    ]
)
def test_ranged_outcomes_leave_each_row_as_the_model_says(
    world: World, steps: list[tuple[str, int, int]]
) -> None:
    world.reset()
    model = Model()
    for step in steps:
        _step(world, model, step)
        _check(world, model)
