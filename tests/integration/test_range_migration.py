"""Migration 0023 (settlement by ranges) moves an existing outbox, with rows in every status and
shape, without rewriting or re-sending a row; its downgrade writes each range member's derived
status on the row first, so the row path of the revision before loses nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from app.db import downgrade, make_engine, migrate
from app.outbox.ranges import RangeStore
from app.outbox.states import Status
from spark_writer.envelope import PARKED
from tests.support.env import copy_database, database_url, drop_database

COLUMNS = (
    "id, message_id, status, attempts, lost_confirms, nacks, ordering_key, stream, not_before, "
    "available_at, lease_owner, confirmed_at, last_error"
)
INSERT = (
    "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, status, "
    "ordering_key, stream, not_before, available_at, lease_owner, lease_until, attempts, "
    "lost_confirms, confirmed_at) VALUES (:m, 'b', :x, :rk, '\\x7b7d', :s, :k, :st, :nb, "
    "coalesce(:at, now()), :lo, :lu, :a, :l, :c)"
)


@pytest.fixture
def at_0022(service_urls: dict[str, str]) -> Iterator[str]:
    """A database of this test's own, migrated to the revision before ranges."""
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = copy_database(admin, template="template0", prefix="outbox_rm_")
    url = database_url(service_urls, name)
    migrate(url, "0022")
    try:
        yield url
    finally:
        drop_database(admin, name)
        admin.dispose()


def _rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(f"SELECT {COLUMNS} FROM outbox ORDER BY id")).all())


def _insert(engine: Engine, **row: Any) -> None:
    values = {"x": "ex", "rk": "rk", "k": None, "st": None, "nb": None, "at": None, "lo": None}
    values |= {"lu": None, "a": 0, "l": 0, "c": None, "s": "pending"} | row
    if values["st"]:
        values["x"] = values["rk"] = ""
    with engine.begin() as conn:
        conn.execute(text(INSERT), values)


def test_an_outbox_in_every_status_and_shape_moves_without_a_rewrite(at_0022: str) -> None:
    engine = make_engine(at_0022)
    n = 0
    for status in Status:
        for shape in ({}, {"k": "key-1"}, {"st": "events"}, {"nb": "2030-01-01T00:00:00+00"}):
            n += 1
            leased = {"lo": "p", "lu": "2030-01-01T00:00:00+00"} if status == "in_flight" else {}
            done = {"c": "2026-01-01T00:00:00+00"} if status == "confirmed" else {}
            _insert(engine, m=f"m{n}", s=status.value, **shape, **leased, **done, a=1, l=n % 2)
    _insert(engine, m="parked", at=PARKED + "+00")
    before = _rows(engine)
    with engine.connect() as conn:
        node = conn.execute(text("SELECT pg_relation_filenode('outbox')")).scalar()
    migrate(at_0022)
    assert _rows(engine) == before, "no existing row changed"
    with engine.begin() as conn:
        assert conn.execute(text("SELECT pg_relation_filenode('outbox')")).scalar() == node
        assert conn.execute(text("SELECT count(*) FROM outbox WHERE xid IS NOT NULL")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM outbox WHERE row_path")).scalar() == 0
        assert conn.execute(text("SELECT id, xid::text FROM outbox_range_cursor")).one()[1] == "0"
    # the row path keeps every old row: a range claim takes none of them, only new plain rows
    _insert(engine, m="new-plain")
    _insert(engine, m="new-keyed", k="key-2")
    claims = RangeStore(engine).claim(owner="p", limit=100, lease_seconds=30)
    assert [r.message_id for c in claims for r in c.rows] == ["new-plain"]
    statuses = RangeStore(engine).statuses([row.id for row in before])
    assert statuses == {row.id: row.status for row in before}, "old rows keep their own status"
    engine.dispose()


def test_a_written_rows_shape_is_fixed_and_an_old_rows_is_not(at_0022: str) -> None:
    engine = make_engine(at_0022)
    _insert(engine, m="old", k="key")
    migrate(at_0022)
    _insert(engine, m="new")
    for change in ("ordering_key = 'k'", "stream = 's', exchange = ''", "not_before = now()"):
        refused = pytest.raises(DBAPIError, match="fixed once a row is written; message_id new")
        with refused, engine.begin() as conn:
            conn.execute(text(f"UPDATE outbox SET {change} WHERE message_id = 'new'"))
    with engine.begin() as conn:  # a row from before 0023 (row path) may still be corrected
        conn.execute(text("UPDATE outbox SET ordering_key = NULL WHERE message_id = 'old'"))
        # other columns of a new row, as the row path writes them
        conn.execute(text("UPDATE outbox SET status = 'skipped' WHERE message_id = 'new'"))
    engine.dispose()


def test_the_downgrade_writes_each_members_derived_status_on_the_row(at_0022: str) -> None:
    migrate(at_0022)
    engine = make_engine(at_0022)
    for i in range(6):
        _insert(engine, m=f"r{i}")
    store = RangeStore(engine)
    (settled,) = store.claim(owner="p", limit=3, lease_seconds=30)
    (leased,) = store.claim(owner="p", limit=3, lease_seconds=30)
    first, second = settled.rows[0].id, leased.rows[0].id
    assert store.adopt(owner="p", range_id=settled.range_id, ids=[first]) == [first]
    assert store.adopt(owner="p", range_id=leased.range_id, ids=[second]) == [second]
    with engine.begin() as conn:  # the row path's outcome on the first: nacked
        conn.execute(
            text("UPDATE outbox SET status = 'nacked', nacks = 1 WHERE id = :i"), {"i": first}
        )
    assert store.settle(owner="p", range_ids=[settled.range_id]) == 1
    derived = store.statuses([r.id for c in (settled, leased) for r in c.rows])
    downgrade(at_0022, "0022")
    rows = {row.id: row for row in _rows(engine)}
    assert {i: rows[i].status for i in derived} == {
        **derived,
        **{r.id: "pending" for r in leased.rows[1:]},  # re-sent by the row path
    }
    assert derived[first] == "nacked" and derived[second] == "in_flight"
    assert all(rows[r.id].confirmed_at is not None for r in settled.rows[1:])
    assert {rows[r.id].lost_confirms for r in leased.rows[1:]} == {1}, "possible duplicates"
    assert rows[second].lease_owner == "p", "the adopted row stays leased on the row path"
    engine.dispose()
