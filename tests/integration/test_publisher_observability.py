"""The publisher never goes blind: outstanding confirms, blocked brokers, its own /metrics and
probes, a report the API reads with the same model, counters that never go down, logs.

Issue 12's regressions: with no ack at all, the tags of slow publishes were never written (the
write-back only woke on an ack); the API's confirm-latency histogram read a key no publisher
wrote; counters went down when a publisher restarted with its id; `outbox publish` logged nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from app.api import create_app
from app.db import make_engine
from app.outbox.store import PublisherStore
from app.publisher.engine import Publisher
from app.settings import Settings
from tests.support.env import REPO
from tests.support.factories import add_rows
from tests.support.fakebroker import FakeBroker
from tests.support.publisher import (
    all_in,
    rows,
    running_publisher,
    settings_for,
    wait_rows,
)

READ = "read-Dn6Tq2Wz9Lc4Xm7Kv3Bh8Rp5Gy1Fs0"
OPERATOR = "oper-Yc3Lq8Vw5Tz2Nm9Kx4Bd7Rh6Gp1Fs0"


@pytest.fixture
async def broker() -> AsyncIterator[FakeBroker]:
    async with FakeBroker() as fake:
        yield fake


def api(db_url: str, engine: Engine) -> httpx.AsyncClient:
    settings = Settings(database_url=db_url, api_token=READ, operator_token=OPERATOR)  # type: ignore[arg-type]
    app = create_app(settings, engine=engine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")


async def get(publisher: Publisher, path: str) -> httpx.Response:
    """A GET of the publisher's own probe server (served by the loop this test runs on)."""
    assert publisher.probes is not None and publisher.probes.url is not None
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(publisher.probes.url + path)


async def scrape(publisher: Publisher) -> dict[str, float]:
    """The publisher's own /metrics over HTTP, as {sample name: value}."""
    text = (await get(publisher, "/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("le") in (None, "+Inf")
    }


# ------------------------------------------------------------------ never blind


async def test_a_broker_that_never_acks_still_shows_every_outstanding_confirm(
    sqlite_url: str, broker: FakeBroker
) -> None:
    """No ack ever comes: within a second the tags and ages are in the database and the API."""
    engine = make_engine(sqlite_url)
    ids = add_rows(engine, n=40, exchange="")
    settings = settings_for(db_url=sqlite_url, amqp_url=broker.url)
    async with running_publisher(settings, engine) as publisher, api(sqlite_url, engine) as c:
        pubs = await broker.wait_published(40)
        sent_at = time.monotonic()
        noted = await wait_rows(engine, lambda rs: all(r.delivery_tag for r in rs), timeout=5)
        assert time.monotonic() - sent_at <= settings.outstanding_after + 1.0
        assert [(r.channel_id, r.delivery_tag) for r in noted] == [
            (p.channel_id, p.tag) for p in pubs
        ]
        r = await c.get(
            "/v1/confirms/outstanding",
            params={"min_age_seconds": 0.5, "limit": 100},
            headers={"Authorization": f"Bearer {READ}"},
        )
        items = r.json()["items"]
        assert [i["message_id"] for i in items] == ids
        assert all(i["delivery_tag"] and i["age_seconds"] >= 0.5 for i in items)
        stats = (await c.get("/v1/stats", headers={"Authorization": f"Bearer {READ}"})).json()
        assert stats["oldest_in_flight_age_seconds"] >= 0.5
        assert (await scrape(publisher))["outbox_publisher_outstanding"] == 40
        broker.start_auto_ack()
        await wait_rows(engine, all_in("confirmed"))
    engine.dispose()


async def test_a_blocked_broker_shows_in_status_stats_and_metrics(
    sqlite_url: str, broker: FakeBroker
) -> None:
    engine = make_engine(sqlite_url)
    add_rows(engine, n=10, exchange="")
    settings = settings_for(db_url=sqlite_url, amqp_url=broker.url)
    auth = {"Authorization": f"Bearer {READ}"}
    async with running_publisher(settings, engine) as publisher, api(sqlite_url, engine) as c:
        await broker.wait_published(10)
        broker.connection.block("low on memory")
        await broker.wait_for(lambda: publisher.metrics.blocked)
        deadline = time.monotonic() + 3
        while not (await c.get("/v1/stats", headers=auth)).json()["broker_blocked"]:
            assert time.monotonic() < deadline, "the block never reached /v1/stats"
            await asyncio.sleep(0.1)
        stats = (await c.get("/v1/stats", headers=auth)).json()
        mine = [p for p in stats["publishers"] if p["publisher_id"] == publisher.publisher_id]
        assert mine[0]["blocked"] and mine[0]["report"]["blocked_reason"] == "low on memory"
        assert (await scrape(publisher))["outbox_publisher_blocked"] == 1
        status = await asyncio.to_thread(_outbox_status, sqlite_url)
        assert "BROKER BLOCKED" in status and "low on memory" in status
        broker.connection.unblock()
        broker.start_auto_ack()
        await wait_rows(engine, all_in("confirmed"))
        await asyncio.sleep(0.2)
        assert (await scrape(publisher))["outbox_publisher_blocked"] == 0
    engine.dispose()


def _outbox_status(db_url: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "status"],
        cwd=REPO,
        text=True,
        env={**env, "OUTBOX_DATABASE_URL": db_url},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# ------------------------------------------------------------------ its own metrics


async def test_a_drain_exports_a_latency_histogram_counting_every_confirm(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    add_rows(engine, n=3000, exchange=topology["exchange"])
    settings = settings_for(db_url=db_url, amqp_url=amqp_url)
    async with running_publisher(settings, engine) as publisher:
        await wait_rows(engine, all_in("confirmed"), timeout=60)
        samples = await scrape(publisher)
        health = await get(publisher, "/healthz")
        ready = await get(publisher, "/readyz")
    assert samples["outbox_publisher_confirm_latency_seconds_count"] == 3000
    assert samples["outbox_publisher_confirmed_total"] == 3000
    assert samples["outbox_publisher_published_total"] == 3000
    assert samples["outbox_publisher_confirm_latency_seconds_sum"] > 0
    assert samples["outbox_publisher_failed_total"] == 0
    assert samples["outbox_publisher_nacked_final_total"] == 0
    assert health.status_code == 200 and health.json()["ok"]
    assert ready.status_code == 200 and ready.json()["broker_connected"]


async def test_the_api_reads_the_report_the_publisher_writes(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    """One model on both sides: what the publisher reports is what /v1/stats shows."""
    add_rows(engine, n=500, exchange=topology["exchange"])
    settings = settings_for(db_url=db_url, amqp_url=amqp_url)
    publisher = Publisher(settings=settings, store=PublisherStore(engine))
    async with asyncio.timeout(60):
        await publisher.run(until_empty=True)
    async with api(db_url, engine) as c:
        stats = (await c.get("/v1/stats", headers={"Authorization": f"Bearer {READ}"})).json()
    (mine,) = [p for p in stats["publishers"] if p["publisher_id"] == publisher.publisher_id]
    report = mine["report"]
    assert (report["confirmed"], report["published"]) == (500, 500)
    assert report["confirm_latency_p50"] is not None and report["held"] == 0
    assert report["metrics_url"].endswith("/metrics")
    assert stats["broker_blocked"] is False


async def test_a_restart_with_the_same_id_never_lowers_a_counter(
    db_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    settings = settings_for(db_url=db_url, amqp_url=amqp_url, publisher_id="obs-same-id")
    totals = []
    for n in (400, 250):
        add_rows(engine, n=n, exchange=topology["exchange"])
        publisher = Publisher(settings=settings, store=PublisherStore(engine))
        async with asyncio.timeout(60):
            await publisher.run(until_empty=True)
        totals.append(publisher.report().confirmed)
    assert totals == [400, 650]
    async with api(db_url, engine) as c:
        stats = (await c.get("/v1/stats", headers={"Authorization": f"Bearer {READ}"})).json()
    (mine,) = [p for p in stats["publishers"] if p["publisher_id"] == "obs-same-id"]
    assert mine["report"]["confirmed"] == 650


# ------------------------------------------------------------------ logs


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_outbox_publish_logs_its_lifecycle(
    fmt: str, sqlite_url: str, amqp_url: str, tmp_path: object
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=sqlite_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_LOG_FORMAT=fmt,
        OUTBOX_PUBLISHER_METRICS_PORT="0",
        OUTBOX_POLL_INTERVAL="0.05",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "publish"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        lines: list[str] = []
        assert proc.stderr is not None
        while not any("connected to the broker" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    lines += rest.splitlines()
    text = "\n".join(lines)
    for event in ("publisher", "started", "connected to the broker", "stopping", "stopped after"):
        assert event in text, f"no {event!r} line in:\n{text}"
    password = amqp_url.split("//", 1)[1].split("@", 1)[0].partition(":")[2]
    assert password and f":{password}@" not in text  # never a secret
    if fmt == "json":
        docs = [json.loads(line) for line in lines if line.strip()]
        assert {d["level"] for d in docs} >= {"INFO"} and all("ts" in d for d in docs)
        assert any(d["logger"] == "app.publisher" for d in docs)
    else:
        assert any(" INFO    app.publisher: publisher " in line for line in lines)


def test_publisher_rows_are_settled_before_the_metrics_test_ends(engine: Engine) -> None:
    """Sanity: the fixtures give each test a database of its own (nothing left from others)."""
    assert rows(engine) == []


async def test_a_taken_metrics_port_moves_the_probes_not_the_publisher(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 48, item 11: a publisher whose metrics port was taken (a second publisher on the
    host) exited. It now publishes, serves its metrics and probes on a free port, and says so at
    ERROR."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    engine = make_engine(sqlite_url)
    try:
        add_rows(engine, n=5, exchange="")
        async with FakeBroker(auto_ack=True) as broker:
            settings = settings_for(
                db_url=sqlite_url, amqp_url=broker.url, publisher_metrics_port=port
            )
            with caplog.at_level("ERROR", logger="app.publisher"):
                async with running_publisher(settings, engine) as publisher:
                    await wait_rows(engine, all_in("confirmed"))
                    assert publisher.probes is not None and publisher.probes.url
                    assert f":{port}" not in publisher.probes.url
        assert f"cannot serve /metrics and the probes on 127.0.0.1:{port}" in caplog.text
    finally:
        taken.close()
        engine.dispose()
