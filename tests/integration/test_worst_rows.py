"""Issue 48, Medium 2: one row can no longer make a response unbounded.

The review stored 20 million ``\\x01`` in a row's ``last_error`` (6 bytes of JSON each): the
message answer was 120 MB, four such reads in parallel took the API to 974 MB, the console page
of a 60 MB reason was 120 MB of HTML, and a republish copied the whole reason into
``outbox_events.detail``. Each reader now cuts every value in the database and says what it cut.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select, update

from app.api import create_app
from app.db import make_engine
from app.outbox.schema import events, outbox
from app.outbox.shown import MAX_SHOWN_BODY, MAX_SHOWN_DOCUMENT, MAX_SHOWN_TEXT
from tests.support.api import OP, READ, R, client_for, settings_for
from tests.support.factories import add_rows
from tests.support.serve import Served

HUGE = 20_000_000  # characters, as in the review
ORIGIN = {"Origin": "http://outbox.test"}
#: A generous bound for any one answer here: every value cut, a page of one worst row.
ANSWER_BOUND = 2 * MAX_SHOWN_BODY


def seed_worst(engine: Engine, *, huge: int = HUGE) -> str:
    """A failed, parked row whose every unbounded value is huge; and one ordinary row."""
    [worst] = add_rows(engine, n=1, batch_id="worst:1", prefix="worst", ordering_key="k-1")
    add_rows(engine, n=1, batch_id="worst:1", prefix="fine")
    reason = "\x01" * huge
    with engine.begin() as conn:
        conn.execute(
            update(outbox)
            .where(outbox.c.message_id == worst)
            .values(
                status="failed",
                attempts=3,
                last_error=reason,
                reply_text=reason,
                reply_code=312,
                headers={"h": "v" * (2 * MAX_SHOWN_DOCUMENT)},
                body=b"b" * (4 * MAX_SHOWN_BODY),
            )
        )
    return worst


@pytest.fixture
def worst_engine(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    try:
        yield engine
    finally:
        engine.dispose()


async def test_every_answer_about_the_worst_row_is_bounded_and_says_what_it_cut(
    db_url: str, worst_engine: Engine
) -> None:
    worst = seed_worst(worst_engine)
    app = create_app(settings_for(db_url), engine=worst_engine)
    async with client_for(app) as c:
        one = await c.get(f"/v1/messages/{worst}", params={"include_body": "true"}, headers=R)
        assert one.status_code == 200 and len(one.content) < ANSWER_BOUND, len(one.content)
        m = one.json()
        assert m["body_size"] == 4 * MAX_SHOWN_BODY
        assert len(m["body_base64"]) == len(
            __import__("base64").b64encode(b"b" * MAX_SHOWN_BODY)
        ), "the first MiB of the body"
        for field in ("last_error", "reply_text"):
            assert m[field].startswith("\x01" * MAX_SHOWN_TEXT)
            assert m[field].endswith(
                f"[cut: {HUGE:,} characters in all, the first {MAX_SHOWN_TEXT:,} shown]"
            )
        assert "unreadable" in m["headers"] and f"{2 * MAX_SHOWN_DOCUMENT + 9:,}" in str(
            m["headers"]
        )
        for path, params in (
            ("/v1/messages", {"batch_id": "worst:1"}),
            ("/v1/failures", {}),
            ("/v1/keys/parked", {}),
            ("/v1/batches/worst:1", {}),
        ):
            r = await c.get(path, params=params, headers=R)
            assert r.status_code == 200 and len(r.content) < ANSWER_BOUND, (path, len(r.content))
        page = (await c.get("/v1/messages", params={"batch_id": "worst:1"}, headers=R)).json()
        assert [m["message_id"] for m in page["items"]] == [worst, "fine-0"], "no row held out"
        [parked] = (await c.get("/v1/keys/parked", headers=R)).json()["items"]
        assert parked["blocking_error"].endswith("shown]")

        r = await c.post(
            "/v1/republish",
            json={"request_id": "worst-1", "message_id": worst},
            headers={**OP, "X-Outbox-Actor": "alice"},
        )
        assert r.status_code == 200 and r.json()["count"] == 1, r.text
    with worst_engine.connect() as conn:
        [detail] = conn.execute(select(events.c.detail).where(events.c.message_id == worst))
        assert detail[0] == "\x01" * MAX_SHOWN_TEXT, "the event keeps the reason's start"


async def test_outstanding_confirms_of_rows_with_huge_names_are_bounded(
    db_url: str, worst_engine: Engine
) -> None:
    """Names no index bounds (an in-flight row's exchange and lease owner, inserted by hand)."""
    ids = add_rows(worst_engine, n=3, batch_id="worst:2", prefix="flight")
    huge = "e" * 5_000_000
    with worst_engine.begin() as conn:
        conn.execute(
            update(outbox)
            .where(outbox.c.message_id.in_(ids))
            .values(
                status="in_flight",
                exchange=huge,
                lease_owner=huge,
                lease_until=dt.datetime(2999, 1, 1, tzinfo=dt.UTC),
                claimed_at=dt.datetime.now(dt.UTC),
            )
        )
    app = create_app(settings_for(db_url), engine=worst_engine)
    async with client_for(app) as c:
        r = await c.get("/v1/confirms/outstanding", headers=R)
    assert r.status_code == 200 and len(r.content) < ANSWER_BOUND, len(r.content)
    items = r.json()["items"]
    assert [i["message_id"] for i in items] == ids
    assert all(
        i["exchange"].endswith("shown]") and i["publisher"].endswith("shown]") for i in items
    )


async def test_the_console_pages_of_the_worst_row_are_bounded(
    sqlite_url: str,
) -> None:
    engine = make_engine(sqlite_url)
    try:
        worst = seed_worst(engine)
        app = create_app(settings_for(sqlite_url), engine=engine)
        async with client_for(app) as c:
            r = await c.post("/ui/login", data={"token": READ}, headers=ORIGIN)
            assert r.status_code == 303
            for path in (
                f"/ui/messages/{worst}",
                "/ui/messages?batch_id=worst:1",
                "/ui/failures",
                "/ui/parked",
                "/ui/batches/worst:1",
            ):
                page = await c.get(path)
                assert page.status_code == 200, (path, page.status_code)
                assert len(page.content) < 512 * 1024, (path, len(page.content))
            whole = (await c.get(f"/ui/messages/{worst}")).text
            assert f"{HUGE:,} characters in all" in whole
            assert f"of {4 * MAX_SHOWN_BODY} bytes" in whole
    finally:
        engine.dispose()


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_a_real_api_serves_four_parallel_reads_of_the_worst_rows_in_256_mib(
    pg_url: str,
) -> None:
    """The review's measurement, on a real ``outbox serve`` over PostgreSQL: four reads in
    parallel of each worst answer (the message with its body, a page, the console page); the
    server's peak RSS stays inside the k8s API pod's 256 Mi limit."""
    engine = make_engine(pg_url)
    try:
        worst = seed_worst(engine)
    finally:
        engine.dispose()
    with Served.outbox(pg_url) as srv:
        sizes = asyncio.run(_four_by_four(srv.base, worst))
        peak = _peak_rss_mib(srv.proc.pid)
    assert max(sizes) < ANSWER_BOUND, sizes
    assert peak < 256, f"peak RSS {peak:.0f} MiB"
    print(json.dumps({"peak_rss_mib": round(peak), "largest_answer": max(sizes)}))


async def _four_by_four(base: str, worst: str) -> list[int]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        r = await c.post("/ui/login", data={"token": READ}, headers={"Origin": base})
        assert r.status_code == 303
        cookie = r.cookies["outbox_session"]

        async def get(path: str, **params: str) -> int:
            headers = {**R, "Cookie": f"outbox_session={cookie}"}
            answer = await c.get(path, params=params, headers=headers)
            assert answer.status_code == 200, (path, answer.status_code)
            return len(answer.content)

        reads = [
            get(f"/v1/messages/{worst}", include_body="true"),
            get("/v1/messages", batch_id="worst:1"),
            get(f"/ui/messages/{worst}"),
            get("/v1/keys/parked"),
        ]
        return list(await asyncio.gather(*(reads * 4)))
