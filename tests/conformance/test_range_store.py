"""app/outbox/ranges.py (settlement by ranges) over generated schedules, on the outbox itself.

test_range_claim.py proves the design's SQL on tables of its own; this drives the product's
:class:`RangeStore` on a migrated outbox, with the writers' own statements: three producers
whose transactions stay open while others commit, Spark's parked rows released by the Spark
writer's own ``RELEASE`` (which re-stamps ``xid``), held batches (``outbox_held``), rows not due
yet and keyed rows (the row path's); and the publisher's steps: claims, settles, adoptions
before an exception (then the exception written as the row path writes it), an operator's skip,
the row path's own claim, and leases that run out (``expire``).

Checked after every claim: no row taken twice, and never one rolled back, parked, held, keyed,
not due or owned by the row path. After every transaction has ended and the cursor is drained:
each range's members are exactly those recorded at its claim; every committed, unparked,
range-shaped row was taken once or is the row path's; the ``row_path`` flags and each row's
status derived by :meth:`RangeStore.statuses` equal the model's; an expired range's members
the row path did not own are pending again, counted as possible duplicates.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.db import make_engine
from app.outbox.ranges import RangeStore
from spark_writer.db import PostgresStore
from spark_writer.envelope import PARKED
from tests.support.env import copy_database, database_url, drop_database

PRODUCERS = 3
OWNER = "publisher-1"
INSERT = (
    "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, available_at, "
    "ordering_key) SELECT %(batch)s || ':' || %(tag)s || ':' || g, %(batch)s, 'ex', 'rk', "
    "'\\x7b7d', coalesce(%(at)s::timestamptz, now()), %(key)s FROM generate_series(1, %(n)s) g "
    "RETURNING id"
)


@dataclass
class World:
    """What the schedule did, as the model sees it."""

    open_rows: dict[int, list[int]] = field(default_factory=dict)  # producer -> uncommitted ids
    open_parked: dict[int, list[str]] = field(default_factory=dict)
    committed: set[int] = field(default_factory=set)
    rolled_back: set[int] = field(default_factory=set)
    parked: dict[str, list[int]] = field(default_factory=dict)  # committed, not released
    releasing: list[str] = field(default_factory=list)
    held: set[str] = field(default_factory=set)
    lifted: set[str] = field(default_factory=set)  # batches whose hold was lifted
    batch_of: dict[int, str] = field(default_factory=dict)
    keyed: set[int] = field(default_factory=set)
    not_due: set[int] = field(default_factory=set)
    taken: dict[int, int] = field(default_factory=dict)  # row -> range
    row_path: dict[int, str] = field(default_factory=dict)  # rows the row path owns: status
    members: dict[int, set[int]] = field(default_factory=dict)  # range -> rows at its claim
    leased: set[int] = field(default_factory=set)
    settled: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)  # handed back by an expired lease
    batches: Iterator[int] = field(default_factory=itertools.count)


class Session:
    def __init__(self, url: str) -> None:
        conninfo = "postgresql://" + url.split("://", 1)[1]
        self.admin = psycopg.connect(conninfo, autocommit=True)
        self.producers = [psycopg.connect(conninfo) for _ in range(PRODUCERS)]
        self.releaser = psycopg.connect(conninfo)
        self.engine = make_engine(url)
        self.store = RangeStore(self.engine)

    def reset(self) -> None:
        for conn in (*self.producers, self.releaser):
            conn.rollback()
        self.admin.execute("TRUNCATE outbox, outbox_ranges, outbox_held RESTART IDENTITY")
        self.admin.execute("UPDATE outbox_range_cursor SET xid = '0', id = 0")

    def close(self) -> None:
        for conn in (*self.producers, self.releaser, self.admin):
            conn.close()
        self.engine.dispose()


@pytest.fixture(scope="module")
def session(service_urls: dict[str, str], pg_template: str) -> Iterator[Session]:
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = copy_database(admin, template=pg_template, prefix="outbox_rs_")
    made = Session(database_url(service_urls, name))
    try:
        yield made
    finally:
        made.close()
        drop_database(admin, name)
        admin.dispose()


def _claim(s: Session, w: World, n: int, *, lease: float = 30.0) -> bool:
    claims = s.store.claim(owner=OWNER, limit=n, lease_seconds=lease)
    for claim in claims:
        for row in claim.rows:
            i = row.id
            assert i not in w.taken, f"row {i} taken twice"
            assert i in w.committed, f"row {i} taken but not committed"
            assert not any(i in ids for ids in w.parked.values()), f"row {i} parked"
            assert w.batch_of[i] not in w.held, f"row {i} of a held batch"
            assert i not in w.row_path, f"row {i} owned by the row path"
            assert i not in w.not_due and i not in w.keyed, f"row {i} not range-shaped or due"
            w.taken[i] = claim.range_id
        w.leased.add(claim.range_id)
    found = s.store.members([c.range_id for c in claims])
    for claim in claims:
        w.members[claim.range_id] = found[claim.range_id]
        published = {r.id for r in claim.rows}
        for i in found[claim.range_id] - published:  # members the claim did not publish
            if i in w.not_due:
                w.row_path.setdefault(i, "pending")  # handed to the row path
            assert i in w.row_path, f"row {i} of range {claim.range_id} neither taken nor owned"
    return bool(claims)


def _publisher_step(s: Session, w: World, kind: str, who: int) -> None:
    leased = sorted(w.leased)
    if kind == "settle" and leased:
        range_id = leased[who % len(leased)]
        assert s.store.settle(owner=OWNER, range_ids=[range_id]) == 1
        w.leased.discard(range_id)
        w.settled.add(range_id)
    elif kind == "except" and leased:  # a nack, a return, a failure or a release back
        range_id = leased[who % len(leased)]
        open_ = sorted(i for i, r in w.taken.items() if r == range_id and i not in w.row_path)
        if open_:
            row = open_[who % len(open_)]
            assert s.store.adopt(owner=OWNER, range_id=range_id, ids=[row]) == [row]
            status = ("nacked", "failed", "pending", "in_flight")[who % 4]
            s.admin.execute("UPDATE outbox SET status = %s WHERE id = %s", (status, row))
            w.row_path[row] = status
    elif kind == "adopt_again" and w.row_path:  # a row the row path owns already: unchanged
        row = sorted(w.row_path)[who % len(w.row_path)]
        range_id = w.taken.get(row, next(iter(w.leased), 0))
        before = s.admin.execute("SELECT status, lease_until FROM outbox WHERE id = %s", (row,))
        was = before.fetchone()
        assert s.store.adopt(owner=OWNER, range_id=range_id, ids=[row]) == []
        now = s.admin.execute("SELECT status, lease_until FROM outbox WHERE id = %s", (row,))
        assert now.fetchone() == was, f"adopting row {row} again changed it"
    elif kind == "expire" and leased:  # the publisher holding it died: its lease runs out
        range_id = leased[who % len(leased)]
        s.admin.execute(
            "UPDATE outbox_ranges SET lease_until = now() - interval '1 s' WHERE range_id = %s",
            (range_id,),
        )
        assert s.store.expire()[0] == 1
        for i in w.members[range_id]:
            if i not in w.row_path:
                w.row_path[i] = "pending"
                w.lost.add(i)
        w.leased.discard(range_id)
        w.settled.add(range_id)  # closed: every member is the row path's


def _row_path_step(s: Session, w: World, kind: str, who: int) -> None:
    if kind == "skip":  # an operator's skip of a row no range took yet
        parked = {i for ids in w.parked.values() for i in ids}
        free = sorted(w.committed - set(w.taken) - set(w.row_path) - parked - w.keyed)
        if free:
            row = free[who % len(free)]
            s.admin.execute(
                "UPDATE outbox SET row_path = true, status = 'skipped' WHERE id = %s", (row,)
            )
            w.row_path[row] = "skipped"
    elif kind == "now_due":
        ready = sorted(w.not_due & w.committed)
        if ready:
            row = ready[who % len(ready)]
            s.admin.execute("UPDATE outbox SET available_at = now() WHERE id = %s", (row,))
            w.not_due.discard(row)
    else:  # the row path's claim of its own pending, due rows
        got = s.admin.execute(
            "UPDATE outbox SET status = 'in_flight', lease_owner = 'row-path', "
            "lease_until = now() + interval '1 h' WHERE row_path AND status = 'pending' "
            "AND available_at <= now() RETURNING id"
        ).fetchall()
        for (row,) in got:
            assert w.row_path.get(row) == "pending" and row not in w.not_due, row
            w.row_path[row] = "in_flight"


def _producer_step(s: Session, w: World, kind: str, who: int, n: int) -> None:
    if kind.startswith("insert"):
        tag = next(w.batches)
        batch = f"b{tag}"
        lifted = sorted(w.lifted - w.held)
        if kind == "insert_rehold" and lifted:  # a batch id held again (a Spark batch re-run)
            batch = lifted[who % len(lifted)]
        if kind in ("insert_held", "insert_rehold"):  # held before its tasks write
            s.admin.execute("INSERT INTO outbox_held (batch_id) VALUES (%s)", (batch,))
            w.held.add(batch)
        at = {"insert_parked": PARKED + "+00", "insert_not_due": "2099-01-01T00:00:00+00"}
        key = "key-1" if kind == "insert_keyed" else None
        cur = s.producers[who].execute(
            INSERT, {"batch": batch, "tag": tag, "at": at.get(kind), "key": key, "n": n}
        )
        ids = [r[0] for r in cur.fetchall()]
        w.open_rows.setdefault(who, []).extend(ids)
        w.batch_of.update((i, batch) for i in ids)
        if kind == "insert_not_due":
            w.not_due |= set(ids)
        if kind == "insert_keyed":
            w.keyed |= set(ids)
        if kind == "insert_parked":
            w.open_parked.setdefault(who, []).append(batch)
    elif kind in ("commit", "rollback"):
        ids = w.open_rows.pop(who, [])
        batches = w.open_parked.pop(who, [])
        if kind == "commit":
            s.producers[who].commit()
            w.committed |= set(ids)
            for batch in batches:
                w.parked[batch] = [i for i in ids if w.batch_of[i] == batch]
        else:
            s.producers[who].rollback()
            w.rolled_back |= set(ids)


def _step(s: Session, w: World, step: tuple[str, int, int]) -> None:
    kind, who, n = step
    if kind.startswith("insert") or kind in ("commit", "rollback"):
        _producer_step(s, w, kind, who, n)
    elif kind in ("settle", "except", "adopt_again", "expire"):
        _publisher_step(s, w, kind, who)
    elif kind in ("skip", "now_due", "row_path_claim"):
        _row_path_step(s, w, kind, who)
    elif kind == "release":  # the Spark writer's own statement, its transaction left open
        waiting = sorted(set(w.parked) - set(w.releasing))
        if waiting:
            batch = waiting[who % len(waiting)]
            s.releaser.execute(PostgresStore.RELEASE, (batch, PostgresStore.PARKED))
            w.releasing.append(batch)
    elif kind == "release_end":
        if who % 2 == 0:
            s.releaser.commit()
            for batch in w.releasing:
                del w.parked[batch]
        else:
            s.releaser.rollback()
        w.releasing.clear()
    elif kind == "unhold":
        if w.held:
            batch = sorted(w.held)[who % len(w.held)]
            s.admin.execute("DELETE FROM outbox_held WHERE batch_id = %s", (batch,))
            w.held.discard(batch)
            w.lifted.add(batch)
    else:
        _claim(s, w, n)


KINDS = [
    *["insert"] * 3,
    "insert_not_due",
    "insert_keyed",
    "insert_parked",
    *["insert_held"] * 2,
    "insert_rehold",
    *["commit"] * 2,
    "rollback",
    "release",
    "release_end",
    "unhold",
    "now_due",
    "skip",
    "row_path_claim",
    *["claim"] * 3,
    "settle",
    "except",
    "adopt_again",
    "expire",
]
STEPS = st.tuples(st.sampled_from(KINDS), st.integers(0, PRODUCERS - 1), st.integers(1, 5))


def _derived_model(w: World, rows: set[int]) -> dict[int, str]:
    def status(i: int) -> str:
        if i in w.row_path:
            return w.row_path[i]
        if i in w.taken:
            return "confirmed" if w.taken[i] in w.settled else "in_flight"
        return "pending"

    return {i: status(i) for i in rows}


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEPS, max_size=40))
# a producer's transaction open while another commits and a claim passes it: a hole, claimed
# once it commits
@example(steps=[("insert", 0, 2), ("insert", 1, 2), ("commit", 1, 0), ("claim", 0, 5)])
# a claim while that transaction is still open must not take its hole as ended
@example(
    steps=[
        ("insert", 0, 2),
        ("insert", 1, 2),
        ("commit", 1, 0),
        ("claim", 0, 5),
        ("claim", 0, 5),
        ("commit", 0, 0),
    ]
)
# a held batch passed, then lifted and claimed late; then held again under the same id, more
# rows written and passed again: that skip is claimed late too, apart
@example(
    steps=[
        ("insert_held", 0, 2),
        ("commit", 0, 0),
        ("insert", 1, 1),
        ("commit", 1, 0),
        ("claim", 0, 5),
        ("unhold", 0, 0),
        ("claim", 0, 5),
        ("insert_rehold", 0, 2),
        ("commit", 0, 0),
        ("insert", 1, 1),
        ("commit", 1, 0),
        ("claim", 0, 5),
    ]
)
# a member adopted for its exception: adopting it again changes nothing
@example(
    steps=[
        ("insert", 0, 3),
        ("commit", 0, 0),
        ("claim", 0, 5),
        ("except", 0, 0),
        ("adopt_again", 0, 0),
    ]
)
# a settled range's members read as confirmed
@example(steps=[("insert", 0, 3), ("commit", 0, 0), ("claim", 0, 5), ("settle", 0, 0)])
# parked rows passed by a claim, then released by the Spark writer's statement
@example(
    steps=[
        ("insert_parked", 0, 2),
        ("commit", 0, 0),
        ("insert", 1, 2),
        ("commit", 1, 0),
        ("claim", 0, 5),
        ("release", 0, 0),
        ("release_end", 0, 0),
    ]
)
# an exception on a member, then the lease runs out: expire leaves the row path's row alone
@example(
    steps=[("insert", 0, 3), ("commit", 0, 0), ("claim", 0, 5), ("except", 0, 0), ("expire", 0, 0)]
)
def test_a_range_store_takes_each_row_once_and_derives_every_status(
    session: Session, steps: list[tuple[str, int, int]]
) -> None:
    session.reset()
    w = World()
    for step in steps:
        _step(session, w, step)
    for who in range(PRODUCERS):
        _step(session, w, ("commit", who, 0))
    _step(session, w, ("release_end", 0, 0))
    while w.held:
        _step(session, w, ("unhold", 0, 0))
    while _claim(session, w, 4):
        pass
    never_released = {i for ids in w.parked.values() for i in ids}
    expected = w.committed - never_released - w.keyed
    assert not set(w.taken) & w.rolled_back
    assert set(w.taken) | set(w.row_path) == expected, (
        "every committed, unparked, range-shaped row taken or on the row path"
    )
    found = session.store.members(sorted(w.members))
    assert {r: ids for r, ids in found.items() if ids} == {
        r: ids for r, ids in w.members.items() if ids
    }, "a range's members changed after its claim"
    flags = {r[0] for r in session.admin.execute("SELECT id FROM outbox WHERE row_path")}
    assert flags == set(w.row_path), "the rows the row path owns"
    everything = w.committed
    derived = session.store.statuses(sorted(everything))
    model = _derived_model(w, expected)
    model |= {i: "pending" for i in (w.keyed | never_released) & everything}
    assert derived == model, "a derived status differs from the model"
    lost = {r[0] for r in session.admin.execute("SELECT id FROM outbox WHERE lost_confirms > 0")}
    assert lost == w.lost, "the members an expired lease handed back, possible duplicates"
