# ruff: noqa: F811 (the console's fixtures, imported from tests.support.console, are parameters)
"""The console over time (issue #28), in a real Chromium against a real ``uvicorn`` over a real
PostgreSQL: batches newest first with page links both ways; the overview's rates, its trend in
words (draining or stuck) and its auto refresh.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy import Engine

from app.api.console.base import PAGE, SECURITY_HEADERS
from tests.support.api import READ, T0, Clock
from tests.support.console import (  # noqa: F401 (fixtures)
    Server,
    _gone,
    browser,
    clock,
    engine,
    shot,
    sign_in,
    text,
)
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

pytestmark = pytest.mark.browser


@pytest.fixture
def server(pg_url: str, engine: Engine, clock: Clock) -> Iterator[Server]:
    with Server(engine, pg_url, clock) as srv:
        yield srv


def _shown_batches(browser: webdriver.Chrome) -> list[str]:
    rows = browser.find_elements(By.CSS_SELECTOR, "#batches tr td:first-child a")
    return [str(r.text) for r in rows]


def _follow(browser: webdriver.Chrome, rel: str) -> None:
    old = browser.find_element(By.TAG_NAME, "html")
    browser.find_element(By.CSS_SELECTOR, f".pager a[rel={rel}]").click()
    WebDriverWait(browser, 15).until(lambda _b: _gone(old))


def test_batches_are_newest_first_with_pages_both_ways(
    browser: webdriver.Chrome, server: Server, engine: Engine, clock: Clock, tmp_path: Path
) -> None:
    # batch n written at minute n: their text order (1, 10, 100, 101, 11, ...) is not their age
    count = PAGE + 12
    for n in range(1, count + 1):
        add_rows(engine, n=2, batch_id=f"orders:{n}", created_at=T0 + dt.timedelta(minutes=n))
    # orders:5 got one more row last: it is the newest now
    add_rows(engine, n=1, batch_id="orders:5", created_at=T0 + dt.timedelta(minutes=count + 1))
    clock.advance(dt.timedelta(hours=2).total_seconds())
    newest_first = ["orders:5"] + [f"orders:{n}" for n in range(count, 0, -1) if n != 5]

    sign_in(browser, server, READ, "/ui/batches")
    assert _shown_batches(browser) == newest_first[:PAGE]
    assert not browser.find_elements(By.CSS_SELECTOR, ".pager a[rel=prev]")
    first = browser.find_element(By.CSS_SELECTOR, "#batches tr:nth-child(2) td.written").text
    assert "2026-11-21 13:03:00 UTC" in first and "min ago" in first, first

    _follow(browser, "next")
    assert _shown_batches(browser) == newest_first[PAGE:]
    shot(browser, "batches-older", tmp_path)
    assert not browser.find_elements(By.CSS_SELECTOR, ".pager a[rel=next]")
    _follow(browser, "prev")
    assert _shown_batches(browser) == newest_first[:PAGE]
    assert not browser.find_elements(By.CSS_SELECTOR, ".pager a[rel=prev]")


def test_a_batches_page_link_not_made_by_the_console_is_a_400_page(
    browser: webdriver.Chrome, server: Server
) -> None:
    sign_in(browser, server, READ, "/ui/batches?cursor=eyJrIjoiYmF0Y2hlcyIsImIiOiJ4In0")
    assert "That page link is not valid" in browser.find_element(By.ID, "message").text


def _click_to(browser: webdriver.Chrome, element_id: str, arrived: Callable[[str], bool]) -> None:
    """Click ``element_id`` until the browser is at a URL ``arrived`` accepts. The page may be
    refreshing itself every 10 s: a refresh between finding the link and clicking it makes the
    link stale, and one just after the click can win over the click's navigation."""

    def attempt(b: webdriver.Chrome) -> bool:
        if arrived(b.current_url):
            return True
        try:
            b.find_element(By.ID, element_id).click()
        except (StaleElementReferenceException, NoSuchElementException):
            return False
        with contextlib.suppress(TimeoutException):
            WebDriverWait(b, 3).until(lambda w: arrived(w.current_url))
        return arrived(b.current_url)

    WebDriverWait(browser, 30, poll_frequency=0.2).until(attempt)


def _settled(
    browser: webdriver.Chrome, read: Callable[[webdriver.Chrome], Any], *, timeout: float = 15
) -> Any:
    """``read(browser)`` once it runs through on one page (not cut by a reload) and is truthy."""
    stale = (StaleElementReferenceException, NoSuchElementException)
    return WebDriverWait(browser, timeout, ignored_exceptions=stale).until(read)


def _drain(engine: Engine, clock: Clock) -> None:
    """100 rows written half an hour ago wait; then for five minutes the publisher confirms 12
    a minute (through the store, as it does) while 2 new rows a minute are written, sampling
    its figures at each minute as its housekeeping does."""
    old = clock.now - dt.timedelta(minutes=30)
    add_rows(engine, n=100, created_at=old, available_at=old)
    repo = OutboxClients(engine, clock=clock)
    confirmed = 0

    def sample() -> None:
        repo.registry.record_sample(
            publisher_id="p1",
            published=confirmed,
            confirmed=confirmed,
            failed=0,
            lost=0,
            latency_p50_ms=2000.0 if confirmed else None,
            latency_p99_ms=2000.0 if confirmed else None,
        )

    sample()
    for _ in range(5):
        got = repo.store.claim(owner="p1", limit=12, lease_seconds=600)
        repo.store.record_published(owner="p1", channel_id=1, tags=[(r.id, r.id) for r in got])
        clock.advance(2)
        repo.store.mark_confirmed(owner="p1", ids=[r.id for r in got])
        confirmed += len(got)
        add_rows(engine, n=2, created_at=clock.now, available_at=clock.now + HOUR)
        clock.advance(58)
        sample()


HOUR = dt.timedelta(hours=1)


def test_the_overview_tells_draining_from_stuck_and_refreshes_when_asked(
    browser: webdriver.Chrome, server: Server, engine: Engine, clock: Clock, tmp_path: Path
) -> None:
    _drain(engine, clock)
    sign_in(browser, server, READ, "/ui")
    shot(browser, "overview-draining", tmp_path)
    assert browser.find_element(By.ID, "trend").text == (
        "Draining: confirming 12/min, writing 2/min; backlog falling "
        "(50 rows waiting, empty in about 5 min)."
    )
    assert "draining" in str(browser.find_element(By.ID, "trend").get_attribute("class"))
    lines = browser.find_elements(By.CSS_SELECTOR, "#rates polyline")
    assert [str(line.get_attribute("class")) for line in lines] == [
        "series written",
        "series confirmed",
        "series failed",
    ]
    assert all(len(str(line.get_attribute("points")).split()) == 60 for line in lines)
    assert text(browser, "rate-confirmed").startswith("confirmed 12/min")
    latency = browser.find_elements(By.CSS_SELECTOR, "#latency-chart polyline")
    assert [len(str(line.get_attribute("points")).split()) for line in latency] == [5, 5]
    assert text(browser, "latency-p99") == "p99 2,000 ms"
    assert "paused" in text(browser, "refresh")
    assert not browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv=refresh]")

    # nothing confirmed for six minutes: the same backlog now reads as stuck
    clock.advance(6 * 60)
    _click_to(browser, "refresh-10", lambda url: url.endswith("/ui?refresh=10"))
    # read in one go (the page reloads itself every 10 s: an element may go stale)
    trend, meta, refresh, as_of = _settled(
        browser,
        lambda b: (
            b.find_element(By.ID, "trend").text,
            b.find_element(By.CSS_SELECTOR, "meta[http-equiv=refresh]").get_attribute("content"),
            b.find_element(By.ID, "refresh").text,
            b.find_element(By.ID, "as-of").text,
        ),
    )
    assert trend == "Stuck: 50 rows waiting and nothing confirmed or failed in the last 5 min."
    assert (meta, refresh) == ("10", "Auto refresh every 10 s · Pause")
    shot(browser, "overview-stuck", tmp_path)
    # the page reloads itself: the next render is later than this one
    clock.advance(30)
    _settled(browser, lambda b: b.find_element(By.ID, "as-of").text != as_of, timeout=25)
    assert "refresh=10" in browser.current_url

    cookie = browser.get_cookie("outbox_session")
    assert cookie is not None
    jar = {"outbox_session": cookie["value"]}
    r = httpx.get(server.base + "/ui?refresh=10", cookies=jar)
    assert r.headers["content-security-policy"] == SECURITY_HEADERS["Content-Security-Policy"]
    assert "<script" not in r.text
    bad = httpx.get(server.base + "/ui?refresh=1", cookies=jar)
    assert bad.status_code == 400 and "Auto refresh runs every 10, 30, 60 seconds" in bad.text
    _click_to(browser, "pause", lambda url: url == server.base + "/ui")
    assert not browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv=refresh]")


def test_a_search_no_index_narrows_reads_the_last_day_and_says_so(
    browser: webdriver.Chrome, server: Server, engine: Engine, clock: Clock
) -> None:
    old = add_rows(engine, n=2, routing_key="apac", created_at=clock.now - 2 * DAY)
    new = add_rows(engine, n=1, routing_key="apac", created_at=clock.now - HOUR)
    sign_in(browser, server, READ, "/ui/messages?routing_key=apac")
    assert "reads the rows written in the last 24 h" in text(browser, "window")
    shown = browser.find_elements(By.CSS_SELECTOR, "#messages tr td:first-child a")
    assert [str(a.text) for a in shown] == new
    assert text(browser, "total") == "1"
    since = browser.find_element(By.NAME, "created_after").get_attribute("value")
    assert since == (clock.now - DAY).isoformat()
    # further back when asked: no window note, the older rows too
    query = urlencode({"routing_key": "apac", "created_after": (clock.now - 3 * DAY).isoformat()})
    browser.get(f"{server.base}/ui/messages?{query}")
    assert not browser.find_elements(By.ID, "window")
    shown = browser.find_elements(By.CSS_SELECTOR, "#messages tr td:first-child a")
    assert [str(a.text) for a in shown] == old + new
    # a status a partial index holds needs no window
    browser.get(f"{server.base}/ui/messages?status=pending")
    assert not browser.find_elements(By.ID, "window") and text(browser, "total") == "3"


DAY = dt.timedelta(days=1)
