"""Issue 48, Low 7: the API's reads have a time bound (``OUTBOX_API_STATEMENT_TIMEOUT``).

A reason search took 1.9 s over 300,000 rows (4.2 s on the console) and nothing bounded it: on a
larger outbox one request holds a database session and a server thread for as long as the scan
takes. Every statement of the API's and the console's reads is now stopped at the bound and the
request answered 503 saying how to narrow it; operator actions are not bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from app.api import create_app
from app.db import bounded, make_engine, stopped_by_bound
from tests.support.api import OP, READ, R, client_for, settings_for
from tests.support.factories import add_rows

ORIGIN = {"Origin": "http://outbox.test"}
HEAVY_SQLITE = (
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000000) "
    "SELECT count(*) FROM n"
)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    try:
        yield engine
    finally:
        engine.dispose()


def test_a_bounded_engine_stops_its_statements_and_leaves_the_pool_unbounded(
    pg_engine: Engine, sqlite_url: str
) -> None:
    reads = bounded(pg_engine, 0.2)
    with reads.connect() as conn:
        conn.execute(text("SELECT 1"))
        with pytest.raises(OperationalError) as stopped:
            conn.execute(text("SELECT pg_sleep(1)"))  # the second statement of the transaction
    assert stopped_by_bound(stopped.value)
    with pg_engine.connect() as conn:  # the same pool, unbounded
        assert conn.execute(text("SELECT pg_sleep(0.4), 1")).one()[1] == 1
    lite = make_engine(sqlite_url)
    try:
        with bounded(lite, 0.05).connect() as conn, pytest.raises(OperationalError) as stopped:
            conn.execute(text(HEAVY_SQLITE))
        assert stopped_by_bound(stopped.value)
        with lite.connect() as conn:
            assert conn.execute(text(HEAVY_SQLITE.replace("20000000", "200000"))).scalar() == (
                200000
            )
    finally:
        lite.dispose()


async def test_a_search_past_the_bound_is_a_503_that_says_how_to_narrow_it(
    pg_url: str, pg_engine: Engine
) -> None:
    """A search waiting on a lock counts as running: an exclusive lock held elsewhere makes
    every read of the outbox outlast the bound, on PostgreSQL deterministically."""
    add_rows(pg_engine, n=3, batch_id="b:1", prefix="tb")
    app = create_app(settings_for(pg_url, api_statement_timeout=0.3), engine=pg_engine)
    locker = make_engine(pg_url)
    try:
        async with client_for(app) as c:
            assert (await c.post("/ui/login", data={"token": READ}, headers=ORIGIN)).status_code
            with locker.connect() as held:
                held.execute(text("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"))
                began = time.monotonic()
                r = await c.get("/v1/messages", params={"reason": "x"}, headers=R)
                took = time.monotonic() - began
                assert r.status_code == 503, r.text
                assert "longer than 0.3 s (OUTBOX_API_STATEMENT_TIMEOUT)" in r.json()["detail"]
                assert "narrow it" in r.json()["detail"] and took < 5
                page = await c.get("/ui/messages", params={"reason": "x"})
                assert page.status_code == 503 and "OUTBOX_API_STATEMENT_TIMEOUT" in page.text
                held.rollback()
            r = await c.get("/v1/messages", params={"reason": "x"}, headers=R)
            assert r.status_code == 200, "the bound holds no state past the request"
    finally:
        locker.dispose()


async def test_an_operator_action_is_not_bounded(pg_url: str, pg_engine: Engine) -> None:
    """A republish waiting longer than the reads' bound still completes."""
    add_rows(pg_engine, n=2, batch_id="b:2", prefix="act", status="failed")
    app = create_app(settings_for(pg_url, api_statement_timeout=0.2), engine=pg_engine)
    locker = make_engine(pg_url)
    try:
        with locker.connect() as held:
            held.execute(text("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"))
            release = threading.Timer(0.8, held.rollback)
            release.start()
            async with client_for(app) as c:
                r = await c.post(
                    "/v1/republish",
                    json={"request_id": "tb-1", "batch_id": "b:2", "statuses": ["failed"]},
                    headers=OP,
                )
            release.join()
        assert r.status_code == 200 and r.json()["count"] == 2, r.text
    finally:
        locker.dispose()


async def test_on_sqlite_a_long_search_is_stopped_too(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        add_rows(engine, n=30_000, batch_id="b:3", prefix="lite", body=b"x")
        for bound, code in ((0.001, 503), (0, 200)):
            app = create_app(settings_for(sqlite_url, api_statement_timeout=bound), engine=engine)
            async with client_for(app) as c:
                r = await c.get("/v1/messages", params={"reason": "nowhere"}, headers=R)
            assert r.status_code == code, (bound, r.text)
    finally:
        engine.dispose()
