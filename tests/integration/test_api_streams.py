"""The REST API and the CLI on rows for RabbitMQ streams (PostgreSQL and SQLite): filters, the
outstanding confirms with lanes and publishing ids, the lanes, possible duplicates that leave
stream rows out (exactly once), failures grouped by stream and a republish scoped to one.

Exchange rows come from :func:`seed_every_state` (one possible duplicate among them); stream
rows are written by ``enqueue`` and moved by the stream relay's store (``StreamStore``):
claimed, resumed after a lost confirm, confirmed, failed. Every count is checked against a
scan of the table.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, func, select

from app.api import create_app
from app.outbox.database import OutboxDatabase
from app.outbox.schema import outbox, stream_lanes
from app.streams.store import StreamStore
from tests.support.api import (
    OP,
    STREAM_FAILURE,
    Clock,
    R,
    StreamSeed,
    client_for,
    seed_every_state,
    seed_streams,
    settings_for,
    statuses_of,
)
from tests.support.cli import env, run  # noqa: F401 (fixture)
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

BAD_STREAMS = ["a\x01b", "s" * 256, "é" * 128, "amq.s"]


@pytest.fixture
def clock() -> Clock:
    # enqueue makes rows due at the database's now(): the stream store's clock is not behind
    return Clock(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))


@pytest.fixture
def streams(engine: Engine, clock: Clock) -> StreamSeed:
    seed_every_state(engine, Clock())  # exchange rows, one a possible duplicate
    return seed_streams(engine, clock)


@pytest.fixture
async def client(
    db_url: str, engine: Engine, clock: Clock, streams: StreamSeed
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings_for(db_url), clock=clock, engine=engine)
    async with client_for(app) as c:
        yield c


def scan(engine: Engine, *where: Any) -> list[Any]:
    """Every row matching ``where``, the whole table read (what the figures must equal)."""
    with engine.connect() as conn:
        return list(conn.execute(select(outbox).where(*where)).all())


def possible_duplicates(engine: Engine) -> int:
    return sum(r.lost_confirms for r in scan(engine, outbox.c.stream.is_(None)))


async def test_stream_rows_are_searchable_and_their_page_says_exactly_once(
    client: httpx.AsyncClient, streams: StreamSeed, engine: Engine
) -> None:
    r = await client.get("/v1/messages", params={"stream": "s-a", "limit": 500}, headers=R)
    assert r.status_code == 200, r.text
    found = {m["message_id"] for m in r.json()["items"]}
    assert found == {row.message_id for row in scan(engine, outbox.c.stream == "s-a")}
    assert len(found) == 6
    resent = streams.confirmed[-1]  # confirmed after its lane resumed: lost_confirms 1
    m = (await client.get(f"/v1/messages/{resent}", headers=R)).json()
    assert (m["stream"], m["exchange"], m["routing_key"], m["lost_confirms"]) == ("s-a", "", "", 1)
    assert m["destination"] == f"stream 's-a', publishing id {m['stream_seq']}"
    assert m["delivery"] == "exactly once" and m["stream_seq"] >= 1
    plain = (await client.get("/v1/messages/order-1-0", headers=R)).json()
    assert (plain["stream"], plain["delivery"]) == (None, "at least once")
    assert plain["destination"] == "exchange 'orders', routing key 'rk'"


async def test_outstanding_shows_stream_rows_with_lane_id_and_holder(
    client: httpx.AsyncClient, streams: StreamSeed, engine: Engine
) -> None:
    r = await client.get("/v1/confirms/outstanding", params={"limit": 1000}, headers=R)
    items = {i["message_id"]: i for i in r.json()["items"]}
    flying = scan(engine, outbox.c.status == "in_flight")
    assert set(items) == {row.message_id for row in flying}
    rows = {row.message_id: row for row in flying if row.stream is not None}
    assert set(rows) == set(streams.in_flight) and rows
    for message_id, row in rows.items():
        got = items[message_id]
        assert (got["stream"], got["lane"], got["stream_seq"]) == (
            "s-a",
            row.id % 2,
            row.stream_seq,
        )
        assert (got["publisher"], got["channel_id"], got["delivery_tag"]) == (
            streams.owner,
            None,
            None,
        )
        assert got["lost_confirms"] == (1 if message_id in streams.resent else 0)
    only = await client.get("/v1/confirms/outstanding", params={"stream": "s-a"}, headers=R)
    assert {i["message_id"] for i in only.json()["items"]} == set(streams.in_flight)
    other = await client.get("/v1/confirms/outstanding", params={"stream": "s-b"}, headers=R)
    assert other.json()["items"] == []


async def test_lanes_show_holder_lease_next_id_takeovers_and_rows_in_flight(
    client: httpx.AsyncClient, streams: StreamSeed, engine: Engine, clock: Clock
) -> None:
    lanes = (await client.get("/v1/streams", headers=R)).json()
    assert [(x["stream"], x["lane"], x["lanes"]) for x in lanes] == [
        ("s-a", 0, 2),
        ("s-a", 1, 2),
        ("s-b", 0, 2),
        ("s-b", 1, 2),
    ]
    flying = scan(engine, outbox.c.status == "in_flight", outbox.c.stream.is_not(None))
    for lane in lanes:
        mine = [r for r in flying if r.stream == lane["stream"] and r.id % 2 == lane["lane"]]
        assert lane["in_flight"] == len(mine)
        given = scan(engine, outbox.c.stream == lane["stream"], outbox.c.id % 2 == lane["lane"])
        assert lane["next_seq"] == 1 + max(r.stream_seq or 0 for r in given)
        assert (lane["owner"], lane["held"], lane["takeovers"]) == (streams.owner, True, 0)
    assert sum(x["in_flight"] for x in lanes) == len(flying) > 0
    clock.advance(61)  # the holder's lease runs out: another publisher takes its lanes over
    store = StreamStore(OutboxDatabase(engine, clock=clock))
    store.acquire(owner="p7#stream", streams=["s-a"], lease_seconds=60)
    after = (await client.get("/v1/streams", params={"stream": "s-a"}, headers=R)).json()
    assert [(x["owner"], x["held"], x["takeovers"]) for x in after] == [("p7#stream", True, 1)] * 2
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(stream_lanes.c.takeovers))).scalar_one() == 2


async def test_possible_duplicates_leave_stream_rows_out(
    client: httpx.AsyncClient, streams: StreamSeed, engine: Engine
) -> None:
    resent = sum(r.lost_confirms for r in scan(engine, outbox.c.stream.is_not(None)))
    assert resent == 3, "the seed has stream rows resent under their ids"
    stats = (await client.get("/v1/stats", headers=R)).json()
    assert stats["possible_duplicates"] == possible_duplicates(engine) == 1
    text = (await client.get("/metrics", headers=R)).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["outbox_possible_duplicates"].samples[0].value == 1
    batch = (await client.get("/v1/batches/streams:1", headers=R)).json()
    assert batch["republished"] == 0 and batch["rows"] == 8


async def test_failures_are_grouped_by_stream_and_a_group_republishes_only_its_rows(
    client: httpx.AsyncClient, streams: StreamSeed, engine: Engine
) -> None:
    groups = (await client.get("/v1/failures", headers=R)).json()["groups"]
    mine = {g["stream"]: g for g in groups if g["reason"] == STREAM_FAILURE}
    assert set(mine) == {"s-a", "s-b"}
    for name, g in mine.items():
        assert (g["rows"], g["exchange"], g["status"]) == (len(streams.failed[name]), "", "failed")
    assert sum(g["rows"] for g in groups) == len(
        scan(engine, outbox.c.status.in_(["failed", "nacked", "returned"]))
    )
    body = {"request_id": "streams-1", "stream": "s-b", "cause": STREAM_FAILURE}
    r = await client.post("/v1/republish", json=body, headers=OP)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == 2 and r.json()["filter"]["stream"] == "s-b"
    assert set(statuses_of(engine, streams.failed["s-b"]).values()) == {"pending"}
    assert set(statuses_of(engine, streams.failed["s-a"]).values()) == {"failed"}
    assert all(r.stream_seq is None for r in scan(engine, outbox.c.stream == "s-b"))
    audit = (await client.get("/v1/audit", headers=R)).json()["items"][0]
    assert audit["filter"]["stream"] == "s-b"
    plain = {"request_id": "orders-1", "exchange": "orders", "dry_run": True}
    shown = (await client.post("/v1/republish", json=plain, headers=OP)).json()["filter"]
    assert shown["stream"] is None


async def test_the_default_exchange_is_a_filter_that_leaves_stream_rows_out(
    client: httpx.AsyncClient, streams: StreamSeed, engine: Engine, clock: Clock
) -> None:
    """``exchange=""`` is the default exchange: a stream row's exchange is empty too, and no
    search, outstanding page or republish of the default exchange reaches it."""
    repo = OutboxClients(engine, clock=clock)
    now = repo.db.clock()
    rows = add_rows(
        engine, n=3, exchange="", routing_key="q", prefix="dx", created_at=now, available_at=now
    )
    claimed = repo.store.claim(owner="p7", limit=500, lease_seconds=600)
    failed = [r.id for r in claimed if r.message_id in rows[:2]]
    repo.store.mark_failed(owner="p7", ids=failed, reason=STREAM_FAILURE)
    default = (outbox.c.exchange == "", outbox.c.stream.is_(None))

    r = await client.get("/v1/messages", params={"exchange": "", "limit": 500}, headers=R)
    assert r.status_code == 200, r.text
    found = {m["message_id"] for m in r.json()["items"]}
    assert found == {row.message_id for row in scan(engine, *default)} == set(rows)
    r = await client.get("/v1/confirms/outstanding", params={"exchange": ""}, headers=R)
    assert r.status_code == 200, r.text
    flying = scan(engine, *default, outbox.c.status == "in_flight")
    assert (
        {i["message_id"] for i in r.json()["items"]} == {rows[2]} == {f.message_id for f in flying}
    )

    body = {"request_id": "default-1", "exchange": "", "cause": STREAM_FAILURE}
    r = await client.post("/v1/republish", json=body, headers=OP)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == 2 and r.json()["filter"]["exchange"] == ""
    assert set(statuses_of(engine, rows[:2]).values()) == {"pending"}
    for name in ("s-a", "s-b"):  # the same reason, an empty exchange: not moved
        assert set(statuses_of(engine, streams.failed[name]).values()) == {"failed"}


@pytest.mark.parametrize("bad", BAD_STREAMS)
async def test_a_stream_filter_rabbitmq_would_refuse_is_a_422_naming_it(
    client: httpx.AsyncClient, bad: str
) -> None:
    for path in ("/v1/messages", "/v1/confirms/outstanding", "/v1/streams"):
        r = await client.get(path, params={"stream": bad}, headers=R)
        assert r.status_code == 422, (path, r.text)
        assert "stream" in r.text, r.text
    body = {"request_id": "bad-1", "stream": bad}
    r = await client.post("/v1/republish", json=body, headers=OP)
    assert r.status_code == 422 and "stream" in r.text, r.text


# ------------------------------------------------------------------------------------ CLI


def test_the_cli_shows_lanes_ids_and_exactly_once(
    env: str,  # noqa: F811 (fixture)
    engine: Engine,
    streams: StreamSeed,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = run(capsys, "outstanding", "--stream", "s-a")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 1 + len(streams.in_flight), out
    for row in scan(engine, outbox.c.stream == "s-a", outbox.c.status == "in_flight"):
        line = next(x for x in lines if x.startswith(row.message_id))
        assert f"lane {row.id % 2}" in line and f"id {row.stream_seq}" in line, line
        assert "stream s-a" in line and streams.owner in line
    rc, out, _ = run(capsys, "streams")
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["stream", "lane", "holder"]
    assert sum("s-a" in x for x in out.splitlines()) == 2
    rc, out, _ = run(capsys, "streams", "--json")
    assert sum(x["in_flight"] for x in json.loads(out)) == len(streams.in_flight)
    rc, out, _ = run(capsys, "message", streams.confirmed[-1])
    assert "exactly once: the broker drops a repeated id (1 resend(s) under the same id)" in out
    assert "stream 's-a', publishing id" in out
    rc, out, _ = run(capsys, "status")
    assert "possible duplicates   1 (rows for exchanges" in out
    rc, out, _ = run(capsys, "failures")
    assert "stream s-b" in out and "stream s-a" in out
    rc, out, _ = run(capsys, "republish", "--stream", "s-b", "--dry-run")
    assert rc == 0 and "would republish 2 of 2" in out and "stream 's-b'" in out, out


@pytest.mark.parametrize("command", ["outstanding", "streams", "republish"])
def test_a_bad_stream_filter_is_a_usage_error(
    env: str,  # noqa: F811 (fixture)
    command: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for bad in BAD_STREAMS:
        with pytest.raises(SystemExit) as exit_:
            run(capsys, command, "--stream", bad)
        assert exit_.value.code == 2
        assert "--stream" in capsys.readouterr().err
