# ruff: noqa: F811 (the console's fixtures, imported from tests.support.console, are parameters)
"""The console on rows for RabbitMQ streams, in a real Chromium against a real ``uvicorn`` over
a real PostgreSQL: the outstanding page shows a stream row's lane and publishing id and the
lanes beneath, a message page says exactly once, a search by stream lists that stream's rows,
a stream's failures are a group of their own whose republish moves exactly them, so are the
default exchange's (an empty exchange, like a stream row's), and a stream name RabbitMQ would
refuse is a clear 400.

Rows are written by ``enqueue`` and moved by the stream relay's store (``seed_streams``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from sqlalchemy import Engine, select

from app.outbox.schema import audit, outbox
from tests.support.api import OPERATOR, READ, STREAM_FAILURE, Clock, StreamSeed, seed_streams
from tests.support.console import (  # noqa: F401 (fixtures)
    Server,
    _settle,
    browser,
    confirm,
    engine,
    moved,
    shot,
    sign_in,
    statuses,
    text,
)
from tests.support.outbox_clients import OutboxClients

pytestmark = pytest.mark.browser


@pytest.fixture
def clock() -> Clock:
    return Clock(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))


@pytest.fixture
def streams(engine: Engine, clock: Clock) -> StreamSeed:
    return seed_streams(engine, clock)


@pytest.fixture
def server(pg_url: str, engine: Engine, clock: Clock, streams: StreamSeed) -> Iterator[Server]:
    with Server(engine, pg_url, clock) as srv:
        yield srv


def test_outstanding_lanes_message_and_search_show_streams(
    browser: webdriver.Chrome, server: Server, streams: StreamSeed, engine: Engine, tmp_path: Path
) -> None:
    sign_in(browser, server, READ, "/ui/outstanding")
    with engine.connect() as conn:
        flying = conn.execute(select(outbox).where(outbox.c.status == "in_flight")).all()
    rows = browser.find_elements(By.CSS_SELECTOR, "#outstanding tr.stream")
    assert len(rows) == len(flying) == len(streams.in_flight)
    for row in flying:
        shown = next(r for r in rows if r.text.startswith(row.message_id)).text
        assert f"lane {row.id % 2}" in shown and f"id {row.stream_seq}" in shown, shown
        assert "stream s-a" in shown and streams.owner in shown and "exactly once" in shown
    lanes = browser.find_elements(By.CSS_SELECTOR, "#lanes tr")[1:]
    assert [" ".join(r.text.split()[:4]) for r in lanes] == [
        "s-a 0 of 2",
        "s-a 1 of 2",
        "s-b 0 of 2",
        "s-b 1 of 2",
    ]
    assert all(streams.owner in r.text and "until" in r.text for r in lanes)
    shot(browser, "outstanding-streams", tmp_path)

    resent = streams.confirmed[-1]  # confirmed after a resend under its publishing id
    browser.get(server.base + "/ui/messages/" + quote(resent))
    destination = text(browser, "destination")
    assert destination.startswith("s-a, publishing id ")
    assert "exactly once: the broker drops a repeated id (1 resend under it" in destination
    assert "not a duplicate" in text(browser, "history")
    assert "may hold a duplicate" not in text(browser, "history")

    browser.get(server.base + "/ui/messages?stream=s-a")
    listed = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#messages tr.found a")}
    assert listed == {f"sa-{i}" for i in range(6)} and text(browser, "total") == "6"
    assert "stream 's-a'" in text(browser, "matches")

    browser.get(server.base + "/ui/messages?stream=" + quote("bad\x01name"))
    assert "must not contain control characters" in text(browser, "message")
    browser.get(server.base + "/ui/messages?stream=" + "s" * 256)
    assert "at most 255 bytes" in text(browser, "message")


def test_a_streams_failures_are_its_own_group_and_republish_only_its_rows(
    browser: webdriver.Chrome, server: Server, streams: StreamSeed, engine: Engine
) -> None:
    sign_in(browser, server, OPERATOR, "/ui/failures")
    groups = browser.find_elements(By.CSS_SELECTOR, "#failures tr.group")
    by_stream = {g.get_attribute("data-stream"): g for g in groups}
    assert set(by_stream) == {"s-a", "s-b"}, "one group per stream, same reason"
    assert int(by_stream["s-b"].find_elements(By.TAG_NAME, "td")[4].text) == 2
    before = statuses(engine)
    described, count = confirm(browser, by_stream["s-b"].find_element(By.CSS_SELECTOR, "button.go"))
    assert described == f"status failed, stream 's-b', reason {STREAM_FAILURE!r}"
    assert count == "2 rows would move back to pending."
    assert moved(before, statuses(engine)) == set(streams.failed["s-b"])
    with engine.connect() as conn:
        doc = conn.execute(select(audit.c.filter).order_by(audit.c.id.desc()).limit(1)).scalar()
    assert doc is not None and doc["stream"] == "s-b" and doc["exchange"] is None


def test_the_default_exchanges_failures_republish_only_its_rows(
    browser: webdriver.Chrome, server: Server, streams: StreamSeed, engine: Engine, clock: Clock
) -> None:
    """The default exchange's group: exchange "" (a stream row's exchange is empty too). Its
    republish, its routing key "" row and its Messages link once dropped the empty exchange and
    reached every exchange's and stream's rows with the same reason."""
    repo = OutboxClients(engine, clock=clock)
    settle = {"engine": engine, "outcome": "failed", "reason": STREAM_FAILURE}
    named = _settle(
        repo, n=3, exchange="", routing_key="q-a", batch_id="d:1", prefix="dq", **settle
    )
    unnamed = _settle(repo, n=2, exchange="", routing_key="", batch_id="d:1", prefix="de", **settle)
    _settle(repo, n=2, exchange="other", routing_key="", batch_id="o:1", prefix="ot", **settle)
    sign_in(browser, server, OPERATOR, "/ui/failures")
    group = browser.find_element(
        By.CSS_SELECTOR, '#failures tr.group[data-exchange=""]:not([data-stream])'
    )
    assert int(group.find_elements(By.TAG_NAME, "td")[4].text) == 5

    group.find_element(By.LINK_TEXT, "Messages").click()
    listed = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#messages tr.found a")}
    assert listed == set(named + unnamed) and text(browser, "total") == "5"
    assert "the default exchange" in text(browser, "matches")

    browser.get(server.base + "/ui/failures")
    key = browser.find_element(
        By.CSS_SELECTOR, '#failures tr.key[data-exchange=""][data-routing-key=""]'
    )
    before = statuses(engine)
    described, count = confirm(browser, key.find_element(By.CSS_SELECTOR, "button.go"))
    assert described == (
        f"status failed, the default exchange, an empty routing key, reason {STREAM_FAILURE!r}"
    )
    assert count == "2 rows would move back to pending."
    assert moved(before, statuses(engine)) == set(unnamed)

    browser.get(server.base + "/ui/failures")
    group = browser.find_element(
        By.CSS_SELECTOR, '#failures tr.group[data-exchange=""]:not([data-stream])'
    )
    before = statuses(engine)
    described, count = confirm(browser, group.find_element(By.CSS_SELECTOR, "button.go"))
    assert described == f"status failed, the default exchange, reason {STREAM_FAILURE!r}"
    assert count == "3 rows would move back to pending."
    assert moved(before, statuses(engine)) == set(named)
    with engine.connect() as conn:
        doc = conn.execute(select(audit.c.filter).order_by(audit.c.id.desc()).limit(1)).scalar()
    assert doc is not None and doc["exchange"] == "" and "stream" not in doc


def test_asking_for_an_empty_field_the_console_does_not_know_is_a_400(
    browser: webdriver.Chrome, server: Server
) -> None:
    sign_in(browser, server, READ, "/ui/messages?empty=batch_id")
    assert "Only the exchange or routing_key may be asked for empty" in text(browser, "message")
