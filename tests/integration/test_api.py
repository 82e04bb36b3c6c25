"""The REST API against a real database holding rows in every state (PostgreSQL and SQLite).

Rows reach their states through the repository (claim, record_published, mark_*, retry, release),
as a publisher would move them; time is a settable clock shared by the repository and the API.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import Engine, insert

from app.api import ApiConfigError, create_app
from app.db import make_engine, migrate
from app.outbox.read.messages import MAX_PAGE_BYTES
from app.outbox.schema import batches, publishers
from tests.support.api import (
    OP,
    OPERATOR,
    READ,
    T0,
    Clock,
    R,
    Seeded,
    audit_rows,
    client_for,
    seed_every_state,
    settings_for,
    statuses_of,
)
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def seeded(engine: Engine, clock: Clock) -> Seeded:
    s = seed_every_state(engine, clock)
    clock.advance(2)  # p1's heartbeat is 2 s old: alive; p0 stopped
    return s


@pytest.fixture
async def client(
    db_url: str, engine: Engine, clock: Clock, seeded: Seeded
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings_for(db_url), clock=clock, engine=engine)
    async with client_for(app) as c:
        yield c


# -------------------------------------------------------------------------------- stats


async def test_stats_show_every_state_ages_latency_and_publishers(
    client: httpx.AsyncClient, clock: Clock
) -> None:
    r = await client.get("/v1/stats", headers=R)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["counts"] == {
        "pending": 2,
        "in_flight": 4,
        "confirmed": 3,
        "returned": 2,
        "nacked": 2,
        "failed": 2,
    }
    assert body["total"] == 15
    # oldest pending: the one written at T0+15.25; oldest unconfirmed publish: T0+16.25
    assert body["oldest_pending_age_seconds"] == pytest.approx(
        (clock.now - T0).total_seconds() - 15.25
    )
    assert body["oldest_in_flight_age_seconds"] == pytest.approx(
        (clock.now - T0).total_seconds() - 16.25
    )
    assert body["confirm_latency"]["samples"] == 3
    assert body["confirm_latency"]["p50"] == pytest.approx(0.25)
    assert body["confirm_latency"]["p99"] == pytest.approx(0.25)
    assert body["possible_duplicates"] == 1
    assert body["publishers_alive"] == 1
    assert {p["publisher_id"]: p["alive"] for p in body["publishers"]} == {"p1": True, "p0": False}


async def test_publishers_stop_counting_as_alive_after_three_heartbeat_intervals(
    client: httpx.AsyncClient, clock: Clock
) -> None:
    clock.advance(3 * 5.0)  # default publisher_heartbeat_interval is 5 s; p1 beat 2 s before
    assert (await client.get("/v1/stats", headers=R)).json()["publishers_alive"] == 0


# ------------------------------------------------------------------ outstanding confirms


async def test_outstanding_confirms_show_publisher_channel_tag_attempt_and_age(
    client: httpx.AsyncClient, seeded: Seeded, clock: Clock
) -> None:
    r = await client.get("/v1/confirms/outstanding", headers=R)
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert r.json()["next_cursor"] is None
    # claimed but not yet published first, then oldest publish first
    assert [i["message_id"] for i in items] == seeded["claimed"] + seeded["in_flight"]
    unsent, *sent = items
    assert (unsent["publisher"], unsent["delivery_tag"]) == ("p2", None)
    # claimed, not yet published (the broker blocks its publisher, say): it ages from its claim
    claimed = dt.datetime.fromisoformat(unsent["claimed_at"])
    assert unsent["age_seconds"] == pytest.approx((clock.now - claimed).total_seconds())
    assert unsent["age_seconds"] >= 2
    assert [(i["publisher"], i["channel_id"], i["delivery_tag"], i["attempt"]) for i in sent] == [
        ("p1", 3, 10, 1),
        ("p1", 3, 11, 1),
        ("p1", 3, 12, 1),
    ]
    assert sent[0]["exchange"] == "orders" and sent[0]["routing_key"] == "rk"
    assert sent[0]["age_seconds"] == pytest.approx((clock.now - T0).total_seconds() - 16.25)


async def test_outstanding_confirms_keyset_pages_see_every_row_once(
    client: httpx.AsyncClient, seeded: Seeded, engine: Engine, clock: Clock
) -> None:
    seen: list[str] = []
    cursor = None
    for page in range(10):
        params = {"limit": 1, **({"cursor": cursor} if cursor else {})}
        body = (await client.get("/v1/confirms/outstanding", params=params, headers=R)).json()
        seen += [i["message_id"] for i in body["items"]]
        if page == 1:  # a publish that goes out while the operator pages lands at the end
            repo = OutboxClients(engine, clock=clock)
            late = add_rows(engine, n=1, batch_id="orders:2", available_at=clock.now)
            got = repo.store.claim(owner="p1", limit=5, lease_seconds=60)
            repo.store.record_published(owner="p1", channel_id=3, tags=[(got[-1].id, 99)])
        cursor = body["next_cursor"]
        if cursor is None:
            break
    expected = seeded["claimed"] + seeded["in_flight"] + late
    assert seen == expected, "keyset pages skip or repeat nothing"


async def test_outstanding_confirms_filter_by_publisher_exchange_batch_and_age(
    client: httpx.AsyncClient, seeded: Seeded, clock: Clock
) -> None:
    async def ids(**params: object) -> list[str]:
        r = await client.get("/v1/confirms/outstanding", params=params, headers=R)
        assert r.status_code == 200, r.text
        return [i["message_id"] for i in r.json()["items"]]

    assert await ids(publisher="p2") == seeded["claimed"]
    assert await ids(exchange="payments") == []
    assert await ids(batch_id="orders:2", publisher="p1") == seeded["in_flight"]
    age_of_second = (clock.now - T0).total_seconds() - 17.25
    assert await ids(min_age_seconds=age_of_second) == seeded["in_flight"][:2]


def _cursor(payload: str) -> str:
    return base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")


CRAFTED = [
    _cursor("[" * 1500 + "]" * 1500),  # deeper than json's recursion limit
    _cursor('{"k":"outstanding","i":1,"s":"0001-01-01T00:00:00+05:00"}'),  # UTC overflows
    _cursor('{"k":"outstanding","i":-1,"s":null}'),
    _cursor('{"k":"batches","b":"a\\u0000b"}'),  # NUL: PostgreSQL text refuses it
    _cursor('{"k":"batches","b":7}'),
]


@pytest.mark.parametrize("cursor", CRAFTED)
async def test_crafted_cursors_are_422_too(client: httpx.AsyncClient, cursor: str) -> None:
    for path in ("/v1/confirms/outstanding", "/v1/batches"):
        r = await client.get(path, params={"cursor": cursor}, headers=R)
        assert r.status_code == 422, (path, r.text)


@pytest.mark.parametrize(
    "cursor",
    [
        "!!!!",
        "abcd",
        "e30",
        "eyJrIjoib3V0c3RhbmRpbmcifQ",  # "{}", {"k":"outstanding"}
        "eyJpIjoxMDAwMDAwMDAwMDAwMDAwMDAwMDAwLCJrIjoib3V0c3RhbmRpbmciLCJzIjpudWxsfQ",  # i=10**21
        "eyJpIjoxLCJrIjoib3V0c3RhbmRpbmciLCJzIjoieWVzdGVyZGF5In0",
    ],  # s="yesterday"
)
async def test_a_cursor_not_made_by_the_endpoint_is_a_422_naming_cursor(
    client: httpx.AsyncClient, cursor: str
) -> None:
    r = await client.get("/v1/confirms/outstanding", params={"cursor": cursor}, headers=R)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["loc"] == ["query", "cursor"]
    r = await client.get("/v1/batches", params={"cursor": cursor}, headers=R)
    assert r.status_code == 422, r.text


# ------------------------------------------------------------------------------ batches


async def test_batches_show_rows_per_status_times_and_republished(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/v1/batches", headers=R)
    assert r.status_code == 200, r.text
    by_id = {b["batch_id"]: b for b in r.json()["items"]}
    assert list(by_id) == NEWEST_FIRST
    one, two, three = by_id["orders:1"], by_id["orders:2"], by_id["orders:3"]
    assert one["counts"] == {
        "pending": 0,
        "in_flight": 0,
        "confirmed": 3,
        "returned": 2,
        "nacked": 2,
        "failed": 0,
    }
    assert (one["sink"], one["spark_batch_id"], one["row_count"], one["rows"]) == (
        "orders",
        1,
        7,
        7,
    )
    assert one["first_published_at"] == "2026-11-21T12:00:00Z"
    assert one["last_published_at"] == "2026-11-21T12:00:00.250000Z"
    assert one["first_confirmed_at"] == one["last_confirmed_at"] == "2026-11-21T12:00:00.250000Z"
    assert two["counts"]["in_flight"] == 4 and two["counts"]["failed"] == 2
    assert two["republished"] == 1 and two["sink"] is None
    assert three["rows"] == 0 and three["rejected_count"] == 5


async def test_batches_page_by_keyset_and_filter_by_status(client: httpx.AsyncClient) -> None:
    seen, cursor = [], None
    for _ in range(5):
        params = {"limit": 1, **({"cursor": cursor} if cursor else {})}
        body = (await client.get("/v1/batches", params=params, headers=R)).json()
        seen += [b["batch_id"] for b in body["items"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == NEWEST_FIRST
    failed = (await client.get("/v1/batches", params={"status": "failed"}, headers=R)).json()
    assert [b["batch_id"] for b in failed["items"]] == ["orders:2"]
    r = await client.get("/v1/batches/orders:1", headers=R)
    assert r.status_code == 200 and r.json()["counts"]["nacked"] == 2


#: The seeded batches by latest write: orders:2's rows came last, orders:1's rows after T0, and
#: orders:3 (no rows) by its record at T0.
NEWEST_FIRST = ["orders:2", "orders:1", "orders:3"]


def _batches_written_out_of_text_order(engine: Engine) -> list[str]:
    """Batches whose text order (1, 10, 100, 11, 2, 7, 8, 9) is not their time order; returns
    their ids newest first by their latest write."""
    written = [("orders:100", 0), ("orders:9", 1), ("orders:10", 2), ("orders:1", 3)]
    written += [("orders:7", 4), ("orders:8", 4), ("orders:11", 5)]
    for batch_id, minute in written:
        add_rows(engine, n=3, batch_id=batch_id, created_at=T0 + dt.timedelta(minutes=minute))
    # a late row makes orders:100 the newest; a recorded batch without rows sits by its record
    add_rows(engine, n=1, batch_id="orders:100", created_at=T0 + dt.timedelta(minutes=9))
    with engine.begin() as conn:
        conn.execute(
            insert(batches),
            [
                {
                    "batch_id": "orders:2",
                    "sink": "orders",
                    "spark_batch_id": 2,
                    "row_count": 0,
                    "rejected_count": 4,
                    "committed_at": T0 + dt.timedelta(minutes=6),
                }
            ],
        )
    order = ["orders:100", "orders:2", "orders:11", "orders:8", "orders:7", "orders:1"]
    return [*order, "orders:10", "orders:9"]


async def test_batches_are_newest_first_and_page_both_ways(
    db_url: str, engine: Engine, clock: Clock
) -> None:
    expected = _batches_written_out_of_text_order(engine)
    app = create_app(settings_for(db_url), clock=clock, engine=engine)
    async with client_for(app) as c:
        first = (await c.get("/v1/batches", headers=R)).json()
        assert [b["batch_id"] for b in first["items"]] == expected
        assert first["next_cursor"] is None and first["prev_cursor"] is None
        top = first["items"][0]
        assert top["written_at"] == "2026-11-21T12:09:00Z" and top["rows"] == 4
        pages, cursor, prev = [], None, None
        while True:
            params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
            body = (await c.get("/v1/batches", params=params, headers=R)).json()
            pages.append([b["batch_id"] for b in body["items"]])
            assert (body["prev_cursor"] is None) == (len(pages) == 1)
            cursor, prev = body["next_cursor"], body["prev_cursor"]
            if cursor is None:
                break
        assert pages == [expected[0:3], expected[3:6], expected[6:8]]
        back = []
        while prev is not None:
            body = (
                await c.get("/v1/batches", params={"limit": 3, "cursor": prev}, headers=R)
            ).json()
            back.append([b["batch_id"] for b in body["items"]])
            assert body["next_cursor"] is not None
            prev = body["prev_cursor"]
        assert back == [expected[3:6], expected[0:3]]
        # a batch written after the list was read comes first when the newest page is read again
        add_rows(engine, n=1, batch_id="orders:9", created_at=T0 + dt.timedelta(minutes=20))
        body = (await c.get("/v1/batches", params={"limit": 3}, headers=R)).json()
        assert [b["batch_id"] for b in body["items"]] == ["orders:9", *expected[0:2]]


# ----------------------------------------------------------------------------- messages


async def test_message_shows_its_history_fields_and_the_body_only_when_asked(
    client: httpx.AsyncClient, seeded: Seeded
) -> None:
    r = await client.get(f"/v1/messages/{seeded.lost}", headers=R)
    assert r.status_code == 200, r.text
    m = r.json()
    assert (m["status"], m["lost_confirms"], m["last_error"]) == ("pending", 1, "channel closed")
    assert (m["channel_id"], m["delivery_tag"], m["body_size"], m["body_base64"]) == (
        2,
        1,
        256,
        None,
    )
    r = await client.get(f"/v1/messages/{seeded['returned'][0]}?include_body=true", headers=R)
    m = r.json()
    assert (m["status"], m["reply_code"], m["reply_text"]) == ("returned", 312, "NO_ROUTE")
    assert m["body_base64"] == base64.b64encode(b"x" * 256).decode()


async def test_unknown_ids_are_404_naming_the_id(client: httpx.AsyncClient) -> None:
    for path in ("/v1/messages/nope", "/v1/batches/nope"):
        r = await client.get(path, headers=R)
        assert r.status_code == 404 and "nope" in r.json()["detail"]
    r = await client.post("/v1/batches/nope/republish", json={"request_id": "x"}, headers=OP)
    assert r.status_code == 404 and "nope" in r.json()["detail"]


# ---------------------------------------------------------------------------- republish


async def test_republish_a_nacked_batch_dry_run_then_real_then_replayed(
    client: httpx.AsyncClient, seeded: Seeded, engine: Engine
) -> None:
    nacked = seeded["nacked"]
    body = {"request_id": "incident-7", "statuses": ["nacked"], "dry_run": True}
    dry = await client.post("/v1/batches/orders:1/republish", json=body, headers=OP)
    assert dry.status_code == 200, dry.text
    assert (dry.json()["count"], dry.json()["audit_id"], dry.json()["dry_run"]) == (2, None, True)
    assert sorted(dry.json()["sample"]) == sorted(nacked)
    assert set(statuses_of(engine, nacked).values()) == {"nacked"}, "a dry run moves nothing"
    assert audit_rows(engine) == []

    real = await client.post(
        "/v1/batches/orders:1/republish",
        json={**body, "dry_run": False},
        headers={**OP, "X-Outbox-Actor": "alice"},
    )
    assert real.status_code == 200, real.text
    out = real.json()
    assert (out["count"], out["replayed"], out["filter"]["batch_id"]) == (2, False, "orders:1")
    assert set(statuses_of(engine, nacked).values()) == {"pending"}
    assert set(statuses_of(engine, seeded["returned"]).values()) == {"returned"}, "filter held"
    [row] = audit_rows(engine)
    assert (row["id"], row["actor"], row["action"], row["count"], row["request_id"]) == (
        out["audit_id"],
        "alice",
        "republish",
        2,
        "incident-7",
    )
    assert row["filter"] == {
        "batch_id": "orders:1",
        "statuses": ["nacked"],
        "exchange": None,
        "created_after": None,
        "created_before": None,
    }

    again = await client.post(
        "/v1/batches/orders:1/republish", json={**body, "dry_run": False}, headers=OP
    )
    assert again.status_code == 200
    assert (again.json()["replayed"], again.json()["count"]) == (True, 2)
    assert again.json()["audit_id"] == out["audit_id"]
    assert len(audit_rows(engine)) == 1, "a replayed request id writes no second audit row"


async def test_reusing_a_request_id_for_another_filter_is_a_409(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    first = {"request_id": "r-1", "statuses": ["returned"]}
    assert (await client.post("/v1/republish", json=first, headers=OP)).status_code == 200
    other = {"request_id": "r-1", "statuses": ["failed"]}
    r = await client.post("/v1/republish", json=other, headers=OP)
    assert r.status_code == 409 and "r-1" in r.json()["detail"]
    assert len(audit_rows(engine)) == 1


async def test_a_request_id_with_another_limit_or_a_dry_run_with_another_filter_is_a_409(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    """Issue 29, Low: the same request_id with a different limit replayed silently, and dry
    runs never checked the id."""
    first = {"request_id": "r-2", "statuses": ["returned"], "limit": 1}
    r = await client.post("/v1/republish", json=first, headers=OP)
    assert r.status_code == 200 and r.json()["count"] == 1, r.text
    for other in ({**first, "limit": 100}, {**first, "statuses": ["failed"], "dry_run": True}):
        r = await client.post("/v1/republish", json=other, headers=OP)
        assert r.status_code == 409 and "r-2" in r.json()["detail"], (other, r.text)
    again = await client.post("/v1/republish", json=first, headers=OP)
    assert again.json()["replayed"] is True
    assert len(audit_rows(engine)) == 1


async def test_concurrent_republishes_with_one_request_id_never_answer_a_false_replay(
    pg_url: str,
) -> None:
    """Issue 29, Medium 5: two concurrent POST /v1/republish with one request_id and different
    batch_ids: in 19 of 20 rounds the loser got ``200 replayed:true count:10`` for its own batch
    while its rows stayed failed (the id was checked before the transaction, the replay path
    compared no filter). 20 rounds, each two requests at once on PostgreSQL (the endpoint runs
    in the server's worker threads): one moves its batch, the other is a 409 and moves nothing."""
    engine = make_engine(pg_url)
    app = create_app(settings_for(pg_url), engine=engine)
    async with client_for(app) as c:
        for round_ in range(20):
            sides = {
                s: add_rows(
                    engine, n=10, batch_id=f"race:{round_}:{s}", status="failed", last_error="boom"
                )
                for s in "ab"
            }
            bodies = [
                {
                    "request_id": f"race-{round_}",
                    "batch_id": f"race:{round_}:{s}",
                    "statuses": ["failed"],
                }
                for s in "ab"
            ]
            answers = await asyncio.gather(
                *(c.post("/v1/republish", json=b, headers=OP) for b in bodies)
            )
            codes = sorted(r.status_code for r in answers)
            assert codes == [200, 409], [(r.status_code, r.text) for r in answers]
            [won] = [r.json() for r in answers if r.status_code == 200]
            assert (won["replayed"], won["count"]) == (False, 10)
            winner = won["filter"]["batch_id"][-1]
            loser = "b" if winner == "a" else "a"
            assert set(statuses_of(engine, sides[winner]).values()) == {"pending"}
            assert set(statuses_of(engine, sides[loser]).values()) == {"failed"}, "loser moved"
    rows = audit_rows(engine)
    engine.dispose()
    assert len(rows) == 20 and len({r["request_id"] for r in rows}) == 20


async def test_republish_by_filter_honours_exchange_time_range_and_limit(
    client: httpx.AsyncClient, seeded: Seeded, engine: Engine
) -> None:
    by_exchange = {"request_id": "a", "exchange": "payments", "dry_run": True}
    r = await client.post("/v1/republish", json=by_exchange, headers=OP)
    assert sorted(r.json()["sample"]) == sorted(seeded["nacked"])
    # created in [T0+5, T0+11): only the failed rows (written at T0+10.25)
    window = {
        "request_id": "b",
        "created_after": "2026-11-21T12:00:05Z",
        "created_before": "2026-11-21T14:00:11+02:00",
        "dry_run": True,
    }
    r = await client.post("/v1/republish", json=window, headers=OP)
    assert r.status_code == 200, r.text
    assert sorted(r.json()["sample"]) == sorted(seeded["failed"])
    unfiltered = {"request_id": "c", "limit": 3}
    r = await client.post("/v1/republish", json=unfiltered, headers=OP)
    assert r.status_code == 422 and "say what to republish" in r.text, r.text  # refused
    limited = {"request_id": "c", "limit": 3, "all": True}
    r = await client.post("/v1/republish", json=limited, headers=OP)
    assert (r.json()["count"], r.json()["matched"]) == (3, 6)
    moved = statuses_of(engine, seeded["returned"] + seeded["nacked"] + seeded["failed"])
    assert sorted(moved.values()).count("pending") == 3


# --------------------------------------------------------------------------------- auth


async def test_auth_refuses_missing_and_unknown_tokens_and_read_tokens_on_writes(
    client: httpx.AsyncClient,
) -> None:
    guess = "Bearer not-the-token-s3cr3t"
    for path in ("/v1/stats", "/v1/batches", "/v1/confirms/outstanding", "/metrics"):
        r = await client.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await client.get(path, headers={"Authorization": guess})
        assert r.status_code == 401 and "not-the-token" not in r.text
        assert (await client.get(path, headers=OP)).status_code == 200, "operator token reads"
    body = {"request_id": "w", "dry_run": True}
    assert (await client.post("/v1/republish", json=body)).status_code == 401
    r = await client.post("/v1/republish", json=body, headers=R)
    assert r.status_code == 403 and "operator token" in r.json()["detail"]
    assert READ not in r.text and OPERATOR not in r.text
    r = await client.post("/v1/batches/orders:1/republish", json=body, headers=R)
    assert r.status_code == 403
    assert (await client.get("/healthz")).json() == {"status": "ok"}


@pytest.mark.parametrize("actor", ["", " leading-space", "tab\there", "x" * 65, "é"])
async def test_an_unprintable_or_long_actor_is_a_422(client: httpx.AsyncClient, actor: str) -> None:
    headers = {**OP, "X-Outbox-Actor": actor.encode()}
    r = await client.post("/v1/republish", json={"request_id": "z"}, headers=headers)
    assert r.status_code == 422, r.text


def test_create_app_refuses_without_tokens_unless_insecure(sqlite_url: str) -> None:
    with pytest.raises(ApiConfigError, match="OUTBOX_API_TOKEN"):
        create_app(settings_for(sqlite_url, api_token=None, operator_token=None))
    with pytest.raises(ApiConfigError, match="must differ"):
        create_app(
            settings_for(sqlite_url, api_token=SecretStr("t"), operator_token=SecretStr("t"))
        )
    create_app(settings_for(sqlite_url, api_token=None, operator_token=None, api_insecure=True))


async def test_insecure_mode_serves_without_tokens_and_audits_anonymous(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        seeded = seed_every_state(engine, Clock())
        settings = settings_for(sqlite_url, api_token=None, operator_token=None, api_insecure=True)
        app = create_app(settings, engine=engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as c:
            assert (await c.get("/v1/stats")).status_code == 200
            r = await c.post("/v1/republish", json={"request_id": "i", "statuses": ["failed"]})
            assert r.status_code == 200 and r.json()["count"] == len(seeded["failed"])
            for host in ("localhost:8080", "[::1]:8080", "127.0.0.2"):
                r = await c.get("/v1/stats", headers={"Host": host})
                assert r.status_code == 200, host
        assert audit_rows(engine)[0]["actor"] == "anonymous (insecure mode)"
    finally:
        engine.dispose()


async def test_insecure_mode_answers_no_request_for_another_host(sqlite_url: str) -> None:
    """Issue 29, Low: insecure mode checked no Host header, so a page whose DNS name was rebound
    to 127.0.0.1 got an operator session (its requests carry its own host name)."""
    settings = settings_for(sqlite_url, api_token=None, operator_token=None, api_insecure=True)
    async with client_for(create_app(settings)) as c:  # Host: outbox.test
        for path in ("/v1/stats", "/ui", "/ui/login"):
            r = await c.get(path)
            assert r.status_code == 421 and "loopback" in r.json()["detail"], (path, r.text)
        r = await c.post("/ui/login", data={"token": ""}, headers={"Origin": "http://outbox.test"})
        assert r.status_code == 421 and "outbox_session" not in r.cookies
        for host in ("evil.example:8080", "127.0.0.1.evil.example", "localhost.evil.example"):
            assert (await c.get("/v1/stats", headers={"Host": host})).status_code == 421, host
    async with client_for(create_app(settings_for(sqlite_url))) as c:  # with tokens: any host
        assert (await c.get("/v1/stats", headers=R)).status_code == 200


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("method", "path", "payload", "field"),
    [
        ("GET", "/v1/confirms/outstanding?limit=0", None, "limit"),
        ("GET", "/v1/confirms/outstanding?limit=1001", None, "limit"),
        ("GET", "/v1/confirms/outstanding?limit=10000000000000000000000", None, "limit"),
        ("GET", "/v1/confirms/outstanding?min_age_seconds=nan", None, "min_age_seconds"),
        ("GET", "/v1/confirms/outstanding?min_age_seconds=1e300", None, "min_age_seconds"),
        ("GET", "/v1/confirms/outstanding?publisher=a%00b", None, "publisher"),
        ("GET", "/v1/batches?status=lost", None, "status"),
        ("GET", "/v1/confirms/outstanding?publisher=a&publisher=b", None, "publisher"),
        ("GET", "/v1/confirms/outstanding?limit=5&limit=6", None, "limit"),
        ("GET", "/v1/confirms/outstanding?publsher=a", None, "publsher"),
        ("GET", "/v1/messages/a%00b", None, "message_id"),
        ("POST", "/v1/republish", {}, "request_id"),
        ("POST", "/v1/republish", {"request_id": "x", "statuses": ["confirmed"]}, "statuses"),
        ("POST", "/v1/republish", {"request_id": "x", "statuses": []}, "statuses"),
        ("POST", "/v1/republish", {"request_id": "x", "limit": 10**9}, "limit"),
        ("POST", "/v1/republish", {"request_id": "x", "stauses": ["failed"]}, "stauses"),
        (
            "POST",
            "/v1/republish",
            {"request_id": "x", "created_after": "2026-01-01T00:00:00"},
            "created_after",
        ),
        (
            "POST",
            "/v1/republish",
            {"request_id": "x", "created_after": "yesterday"},
            "created_after",
        ),
        (
            "POST",
            "/v1/republish",
            {"request_id": "x", "created_after": "0001-01-01T00:00:00+05:00"},
            "created_after",
        ),
        (
            "POST",
            "/v1/republish",
            {
                "request_id": "x",
                "created_after": "2026-01-02T00:00:00Z",
                "created_before": "2026-01-01T00:00:00Z",
            },
            "created_after",
        ),
    ],
)
async def test_bad_requests_are_422_naming_the_field(
    client: httpx.AsyncClient, method: str, path: str, payload: object, field: str
) -> None:
    r = await client.request(method, path, json=payload, headers=OP)
    assert r.status_code == 422, r.text
    assert field in r.text


async def test_malformed_json_and_wrong_types_are_4xx(client: httpx.AsyncClient) -> None:
    for raw in (b"{", b"[]", b'"x"', b"null", b'{"request_id": 5}', b"\xff\xfe"):
        r = await client.post(
            "/v1/republish", content=raw, headers={**OP, "Content-Type": "application/json"}
        )
        assert 400 <= r.status_code < 500, (raw, r.status_code, r.text)
    r = await client.post(
        "/v1/republish",
        content=b"request_id=x",
        headers={**OP, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 415


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"request_id": "x", "batch_id": "\\ud800"}', "lone surrogate"),
        (b'{"request_id": "x", "batch_id": "b", "limit": 1e999999}', "out of range"),
        (b'{"request_id": "x", "batch_id": "b", "limit": NaN}', "NaN is not JSON"),
        (b'{"request_id": "x", "batch_id": "b", "limit": -Infinity}', "-Infinity is not JSON"),
        (
            b'{"request_id": "x", "batch_id": "b", "dry_run": true, "dry_run": false}',
            "duplicate key 'dry_run'",
        ),
        (b'{"request_id": "x", "batch_id": "b\xff"}', "not UTF-8"),
    ],
)
async def test_json_that_python_would_accept_but_is_not_json_is_a_400(
    client: httpx.AsyncClient, engine: Engine, raw: bytes, says: str
) -> None:
    """Each would otherwise be read: a duplicate key silently takes the last value (a real
    republish instead of the dry run asked for first), NaN and 1e999999 become floats."""
    r = await client.post(
        "/v1/republish", content=raw, headers={**OP, "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and says in r.json()["detail"], r.text
    assert audit_rows(engine) == []  # nothing moved, nothing audited


async def test_a_large_body_is_refused_before_parsing_and_before_auth(
    client: httpx.AsyncClient,
) -> None:
    big = b'{"request_id": "x", "batch_id": "' + b"a" * 200_000 + b'"}'
    for headers in ({}, OP):  # without any token: the size is checked first
        r = await client.post(
            "/v1/republish", content=big, headers={**headers, "Content-Type": "application/json"}
        )
        assert r.status_code == 413, r.text
        assert r.headers["content-type"] == "application/problem+json"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
        for _ in range(20):
            yield b"a" * 10_000

    r = await client.post(
        "/v1/republish", content=chunks(), headers={**OP, "Content-Type": "application/json"}
    )
    assert r.status_code == 413


async def test_a_deeply_nested_body_is_a_4xx_and_without_a_token_counts_as_a_failure(
    sqlite_url: str,
) -> None:
    """Issue 29, Low: 60 KB of nested ``[`` without a token answered 500 with a traceback
    (``strict_loads`` missed RecursionError), and did not count in the throttle."""
    nested = b"[" * 60_000
    json_type = {"Content-Type": "application/json"}
    app = create_app(settings_for(sqlite_url, api_auth_failures_per_minute=3))
    async with client_for(app) as c:
        r = await c.post("/v1/republish", content=nested, headers={**OP, **json_type})
        assert r.status_code == 400 and "nested too deeply" in r.json()["detail"], r.text
        codes = [
            (await c.post("/v1/republish", content=nested, headers=json_type)).status_code
            for _ in range(5)
        ]
        assert codes == [401] * 3 + [429] * 2, "a body without a token is a failed sign-in"


async def test_failed_authentications_are_rate_limited_per_client(sqlite_url: str) -> None:
    app = create_app(settings_for(sqlite_url, api_auth_failures_per_minute=5))
    async with client_for(app) as c:
        codes = [
            (await c.get("/v1/stats", headers={"Authorization": f"Bearer wrong-{i}"})).status_code
            for i in range(7)
        ]
        assert codes == [401] * 5 + [429] * 2
        r = await c.get("/v1/stats", headers={"Authorization": "Bearer wrong-again"})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0  # this client waits


async def test_over_its_budget_a_client_cannot_tell_a_right_guess_from_a_wrong_one(
    sqlite_url: str,
) -> None:
    """Issue 48, Medium 1: the valid token was checked before the throttle, so an address over
    its budget got 429 for every wrong token and 200 for the right one (4,203 guesses in 8 s).
    Now every request of that address gets the same 429 until the window passes, the right
    token's too; other addresses are not affected, and only failures are counted."""
    engine = make_engine(sqlite_url)
    try:
        seed_every_state(engine, Clock())
        app = create_app(settings_for(sqlite_url), engine=engine)
        async with client_for(app) as c:
            for i in range(20):
                r = await c.get("/v1/stats", headers={"Authorization": f"Bearer wrong-{i}"})
                assert r.status_code == 401
            wrong = await c.get("/v1/stats", headers={"Authorization": "Bearer wrong"})
            answers = [wrong] + [await c.get("/v1/stats", headers=h) for h in (R, OP)]
            assert [a.status_code for a in answers] == [429, 429, 429]
            assert len({(a.text, a.headers["retry-after"]) for a in answers}) == 1
            other = httpx.ASGITransport(app=app, client=("198.51.100.9", 40000))  # type: ignore[arg-type]
            async with httpx.AsyncClient(transport=other, base_url="http://outbox.test") as o:
                assert (await o.get("/v1/stats", headers=R)).status_code == 200
            throttle = app.state.ctx.throttle
            throttle.clock = lambda: time.monotonic() + 61  # the window passes
            assert (await c.get("/v1/stats", headers=R)).status_code == 200
            assert (await c.get("/v1/stats", headers=OP)).status_code == 200
            for _ in range(19):  # the right tokens did not count; 19 failures do not throttle
                await c.get("/v1/stats", headers={"Authorization": "Bearer wrong"})
            assert (await c.get("/v1/stats", headers=R)).status_code == 200
    finally:
        engine.dispose()


async def test_the_audit_row_records_the_token_and_the_client_address(
    client: httpx.AsyncClient, seeded: Seeded, engine: Engine
) -> None:
    body = {"request_id": "who-1", "statuses": ["nacked"]}
    r = await client.post(
        "/v1/republish", json=body, headers={**OP, "X-Outbox-Actor": "mallory-claims-alice"}
    )
    assert r.status_code == 200, r.text
    [row] = audit_rows(engine)
    assert row["actor"] == "mallory-claims-alice"  # what the client claims, kept as a claim
    assert row["principal"] == "operator-token" and row["client_addr"] == "127.0.0.1"


GUESSABLE = [
    "short-token",
    "CHANGE-ME-operator-0123456789abcdefghijkl",
    "aaaaaaaaaaaaaaaa",  # issue 48, Medium 1: three tokens accepted at start-up
    "1234567890123456",
    "Operator-Pass-2026",
    "a" * 40,
    "1234567890" * 4,
    "abcdefghijklmnopqrstuvwxyz0123456789",
    "Operator-Pass-2026-Operator-Pass-2026",
    "0a1b0a1b0a1b0a1b0a1b0a1b0a1b0a1b0a1b",
]


@pytest.mark.parametrize("token", GUESSABLE)
def test_guessable_tokens_are_refused_at_start(sqlite_url: str, token: str) -> None:
    with pytest.raises(ApiConfigError, match=r"OUTBOX_OPERATOR_TOKEN .*`outbox token`") as err:
        create_app(settings_for(sqlite_url, operator_token=SecretStr(token)))
    assert token not in str(err.value), "the error never quotes the token"


def test_outbox_token_gives_tokens_the_api_accepts(sqlite_url: str) -> None:
    made = [
        subprocess.run(
            [sys.executable, "-m", "app.cli", "token"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert made[0] != made[1] and all(len(t) == 43 for t in made)
    create_app(
        settings_for(sqlite_url, api_token=SecretStr(made[0]), operator_token=SecretStr(made[1]))
    )


# ------------------------------------------------------------------------------ metrics


METRICS = "metrics-Jx5Qw8Lc2Tz7Vm4Kb9Nd3Rp6Gy1Fs0"


async def test_the_metrics_token_reads_metrics_and_nothing_else(sqlite_url: str) -> None:
    """Issue 48, Low 6: /metrics needed the read token, which also reads message bodies; a
    Prometheus server now gets a token that reads /metrics only."""
    engine = make_engine(sqlite_url)
    seeded = seed_every_state(engine, Clock())
    app = create_app(settings_for(sqlite_url, metrics_token=SecretStr(METRICS)), engine=engine)
    m = {"Authorization": f"Bearer {METRICS}"}
    async with client_for(app) as c:
        assert (await c.get("/metrics", headers=m)).status_code == 200
        assert (await c.get("/metrics", headers=R)).status_code == 200, "the read token too"
        for path in ("/v1/stats", f"/v1/messages/{seeded.lost}?include_body=true", "/v1/failures"):
            r = await c.get(path, headers=m)
            assert r.status_code == 403 and "reads /metrics only" in r.json()["detail"], path
        r = await c.post("/v1/republish", json={"request_id": "m-1", "all": True}, headers=m)
        assert r.status_code == 403
        page = await c.post(
            "/ui/login", data={"token": METRICS}, headers={"Origin": "http://outbox.test"}
        )
        assert page.status_code == 403 and "outbox_session" not in page.cookies
        assert "reads /metrics only" in page.text
    engine.dispose()


@pytest.mark.parametrize(
    ("metrics", "why"),
    [(READ, "must differ"), (OPERATOR, "must differ"), ("metrics-" + "m" * 30, "distinct")],
)
def test_the_metrics_token_must_differ_and_not_be_guessable(
    sqlite_url: str, metrics: str, why: str
) -> None:
    with pytest.raises(ApiConfigError, match=why):
        create_app(settings_for(sqlite_url, metrics_token=SecretStr(metrics)))


async def test_metrics_are_what_the_database_knows(client: httpx.AsyncClient) -> None:
    """The API's /metrics: rows per status and ages from the outbox, nothing rebuilt from the
    publishers' reports (their counters and histograms are on their own ports)."""
    r = await client.get("/metrics", headers=R)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }

    def v(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert v("outbox_rows", status="failed") == 2
    assert v("outbox_in_flight") == 4
    assert v("outbox_possible_duplicates") == 1
    assert v("outbox_publishers_alive") == 1
    assert v("outbox_oldest_pending_age_seconds") > 0
    names = {name for name, _ in samples}
    assert not {n for n in names if "confirm_latency" in n or n.startswith("outbox_publisher_")}
    assert "outbox_published_total" not in names


async def test_metrics_and_stats_survive_malformed_publisher_stats(sqlite_url: str) -> None:
    """Anyone with write access can put anything in outbox_publishers.stats: the API still
    answers, and shows the malformed report as absent."""
    engine = make_engine(sqlite_url)
    bad = [
        None,
        [],
        {"published": "many", "confirmed": -1, "confirm_latency_buckets": "x"},
        {"published": 5, "confirm_latency_buckets": {"abc": 1, "0.1": "two", "nan": 3}},
    ]
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(publishers),
                [
                    {
                        "publisher_id": f"b{i}",
                        "hostname": "h",
                        "pid": i,
                        "started_at": T0,
                        "heartbeat_at": T0,
                        "stats": stats,
                    }
                    for i, stats in enumerate(bad)
                ],
            )
        async with client_for(create_app(settings_for(sqlite_url), engine=engine)) as c:
            r = await c.get("/metrics", headers=R)
            assert r.status_code == 200, r.text
            assert "outbox_rows" in r.text
            r = await c.get("/v1/stats", headers=R)
            assert r.status_code == 200, r.text
    finally:
        engine.dispose()


# ------------------------------------------------------------------------ health, errors


async def test_readyz_checks_database_and_schema_not_the_broker(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The broker is unreachable (port 1) and the API is ready all the same: it never needs it."""
    ok = create_app(settings_for(sqlite_url))
    async with client_for(ok) as c:
        r = await c.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["ready"] is True
    old = f"sqlite:///{tmp_path / 'old.db'}"
    migrate(old, "0001")
    behind = create_app(settings_for(old))
    async with client_for(behind) as c:
        r = await c.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["database"]["ok"] is True
    assert body["migrations"]["ok"] is False and "migrate" in body["migrations"]["detail"]
    assert "broker" not in body
    assert "guest" not in r.text, "no URL (or password) in the answer"


async def test_an_unreachable_database_is_a_503_not_a_500() -> None:
    url = "postgresql+psycopg://outbox:pw-s3cret@127.0.0.1:1/outbox"
    app = create_app(settings_for(url))
    async with client_for(app) as c:
        r = await c.get("/v1/stats", headers=R)
        ready = await c.get("/readyz")
    assert r.status_code == 503 and "database unavailable" in r.json()["detail"]
    assert ready.status_code == 503 and ready.json()["database"]["ok"] is False
    assert "s3cret" not in r.text + ready.text


def test_importing_the_api_needs_no_database() -> None:
    code = "import app.api, app.cli; print('ok')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DATABASE_URL"] = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "ok"


async def test_failures_are_grouped_by_cause_and_audit_is_listed(
    client: httpx.AsyncClient, seeded: Seeded
) -> None:
    r = await client.get("/v1/failures", headers=R)
    assert r.status_code == 200, r.text
    body = r.json()
    assert {g["status"] for g in body["groups"]} == {"returned", "nacked", "failed"}
    returned = next(g for g in body["groups"] if g["status"] == "returned")
    assert "NO_ROUTE" in returned["reason"] and returned["sample_message_id"] in seeded["returned"]
    r = await client.post(
        "/v1/republish",
        json={"request_id": "aud-1", "statuses": ["nacked"]},
        headers={**OP, "X-Outbox-Actor": "carol"},
    )
    assert r.status_code == 200, r.text
    r = await client.get("/v1/audit", headers=R)
    assert r.status_code == 200, r.text
    (first, *_) = r.json()["items"]
    assert (first["action"], first["actor"], first["principal"]) == (
        "republish",
        "carol",
        "operator-token",
    )


async def test_messages_are_searchable_by_status_exchange_and_reason_in_pages(
    client: httpx.AsyncClient, seeded: Seeded
) -> None:
    url = "/v1/messages"
    r = await client.get(url, params={"status": ["returned", "nacked"]}, headers=R)
    assert r.status_code == 200, r.text
    got = {m["message_id"] for m in r.json()["items"]}
    assert got == set(seeded["returned"]) | set(seeded["nacked"])
    assert all(m["body_base64"] is None for m in r.json()["items"])  # no bodies in a search
    r = await client.get(url, params={"reason": "no_route"}, headers=R)
    assert {m["message_id"] for m in r.json()["items"]} == set(seeded["returned"])
    pages: list[str] = []
    after = None
    while True:
        params = {"limit": 2, **({"after": after} if after is not None else {})}
        body = (await client.get(url, params=params, headers=R)).json()
        pages += [m["message_id"] for m in body["items"]]
        after = body["next_after"]
        if after is None:
            break
    assert len(pages) == len(set(pages)) > 4  # every row once, in id order
    r = await client.get(url, params={"reason": "%"}, headers=R)
    assert r.status_code == 200 and r.json()["items"] == []  # no wildcard injection


async def test_messages_list_filters_by_created_range_and_refuses_an_empty_range(
    client: httpx.AsyncClient, seeded: Seeded
) -> None:
    stored = (await client.get("/v1/messages", params={"limit": 500}, headers=R)).json()["items"]
    assert len(stored) > 4
    created = sorted(dt.datetime.fromisoformat(m["created_at"]) for m in stored)
    first, last = created[0], created[-1]
    later = (last + dt.timedelta(days=1)).isoformat()
    everything = {"created_after": first.isoformat(), "created_before": later, "limit": 500}
    r = await client.get("/v1/messages", params=everything, headers=R)
    assert r.status_code == 200 and len(r.json()["items"]) == len(stored), r.text
    r = await client.get("/v1/messages", params={"created_after": later}, headers=R)
    assert r.status_code == 200 and r.json()["items"] == []
    backwards = {"created_after": later, "created_before": first.isoformat()}
    r = await client.get("/v1/messages", params=backwards, headers=R)
    assert r.status_code == 422 and "earlier than" in r.json()["detail"], r.text
    r = await client.get("/v1/messages", params={"created_after": "yesterday"}, headers=R)
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["query", "created_after"]


async def test_a_page_of_large_rows_stays_within_the_byte_budget_and_pages_on(
    client: httpx.AsyncClient, engine: Engine
) -> None:
    """Issue 29, Medium 4: ``GET /v1/messages?batch_id=…&limit=500`` over 40 rows with 1 MB
    header and property documents answered 80 MB (RSS 109 -> 407 MB). A page now stops at
    about 4 MiB of row text, says so, and ``next_after`` reaches every row."""
    big = add_rows(
        engine,
        n=12,
        batch_id="big:1",
        headers={"h": "x" * 900_000},
        properties={"correlation_id": "c", "type": "y" * 900_000},
    )
    small = add_rows(engine, n=3, batch_id="big:1")
    seen: list[str] = []
    after = None
    for _ in range(20):
        params = {"batch_id": "big:1", "limit": 500, **({"after": after} if after else {})}
        r = await client.get("/v1/messages", params=params, headers=R)
        assert r.status_code == 200, r.text[:200]
        assert len(r.content) <= MAX_PAGE_BYTES + 64 * 1024, len(r.content)
        page = r.json()
        seen += [m["message_id"] for m in page["items"]]
        assert page["items"][0]["headers"]["h"] == "x" * 900_000, "rows come whole"
        after = page["next_after"]
        assert page["truncated"] == (after is not None)
        if after is None:
            break
    assert seen == big + small, "paging reaches every row once, in order"


# ------------------------------------------------------------------------------ problem details


def _is_problem(r: httpx.Response, status: int, path: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json", r.headers
    body = r.json()
    assert body["status"] == status and body["type"] == "about:blank", body
    assert body["title"] and isinstance(body["detail"], str) and body["detail"], body
    assert body["instance"] == path, body
    return dict(body)


async def test_every_error_is_an_rfc9457_problem(client: httpx.AsyncClient) -> None:
    """A wrong token, a read token acting, an unknown id, path and method, a bad query and a
    bad body: each a problem document naming what is wrong, never FastAPI's bare ``detail``."""
    _is_problem(await client.get("/v1/stats"), 401, "/v1/stats")
    bad = await client.get("/v1/stats", headers={"Authorization": "Bearer " + "x" * 40})
    assert "www-authenticate" in bad.headers
    _is_problem(bad, 401, "/v1/stats")
    acted = await client.post("/v1/republish", json={"all": True, "actor": "t"}, headers=R)
    assert "operator token" in str(_is_problem(acted, 403, "/v1/republish")["detail"])
    gone = await client.get("/v1/messages/nope", headers=R)
    assert "nope" in str(_is_problem(gone, 404, "/v1/messages/nope")["detail"])
    _is_problem(await client.get("/v1/no-such-thing", headers=R), 404, "/v1/no-such-thing")
    _is_problem(await client.delete("/v1/stats", headers=R), 405, "/v1/stats")
    invalid = _is_problem(
        await client.get("/v1/batches", params={"limit": "many"}, headers=R), 422, "/v1/batches"
    )
    assert "query.limit" in str(invalid["detail"]), invalid
    assert invalid["errors"] == [  # type: ignore[comparison-overlap]
        {
            "loc": ["query", "limit"],
            "msg": "Input should be a valid integer, unable to parse string as an integer",
            "type": "int_parsing",
        }
    ]
    not_json = await client.post(
        "/v1/republish",
        content=b'{"all": true, "all": false}',
        headers={**OP, "content-type": "application/json"},
    )
    assert "duplicate key" in str(_is_problem(not_json, 400, "/v1/republish")["detail"])


async def test_an_unreachable_database_is_a_problem_too() -> None:
    app = create_app(settings_for("postgresql+psycopg://outbox:pw@127.0.0.1:1/outbox"))
    async with client_for(app) as c:
        body = _is_problem(await c.get("/v1/batches", headers=R), 503, "/v1/batches")
    assert "database unavailable" in str(body["detail"])


async def test_the_api_documentation_pages_are_off_unless_asked_for(sqlite_url: str) -> None:
    """Issue 29, Low: /docs, /redoc and /openapi.json were open on the console's origin without
    its CSP or frame protection, loading unpinned scripts from a CDN."""
    pages = ("/docs", "/redoc", "/openapi.json")
    async with client_for(create_app(settings_for(sqlite_url))) as c:
        assert [(await c.get(p)).status_code for p in pages] == [404] * 3
    async with client_for(create_app(settings_for(sqlite_url, api_docs=True))) as c:
        assert [(await c.get(p)).status_code for p in pages] == [200] * 3


async def test_answers_over_https_carry_hsts(sqlite_url: str) -> None:
    """Issue 29, Low: no HSTS over HTTPS (a first plain-HTTP visit could be downgraded)."""
    app = create_app(settings_for(sqlite_url))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="https://outbox.test") as c:
        for path in ("/healthz", "/v1/stats", "/ui/login", "/v1/nope"):
            r = await c.get(path)
            assert r.headers["strict-transport-security"] == "max-age=31536000", path
    async with client_for(app) as c:  # plain HTTP: void there, not sent
        assert "strict-transport-security" not in (await c.get("/healthz")).headers


def test_the_openapi_document_declares_problem_json_for_every_error(sqlite_url: str) -> None:
    doc = create_app(settings_for(sqlite_url)).openapi()
    errors = [
        (path, code, answer)
        for path, ops in doc["paths"].items()
        for op in ops.values()
        for code, answer in op["responses"].items()
        if code[0] in "45" and path != "/readyz"
    ]
    assert len(errors) > 30
    for path, code, answer in errors:
        assert list(answer["content"]) == ["application/problem+json"], (path, code)
        assert answer["content"]["application/problem+json"]["schema"] == {
            "$ref": "#/components/schemas/Problem"
        }
    assert "HTTPValidationError" not in doc["components"]["schemas"]
