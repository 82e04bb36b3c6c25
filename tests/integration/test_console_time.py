# ruff: noqa: F811 (the console's fixtures, imported from its test module, are parameters here)
"""The console over time (issue #28), in a real Chromium against a real ``uvicorn`` over a real
PostgreSQL: batches newest first with page links both ways.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy import Engine

from app.api.console.base import PAGE
from tests.factories import add_rows
from tests.integration.test_api import READ, T0, Clock
from tests.integration.test_console import (  # noqa: F401 (fixtures)
    Server,
    _gone,
    browser,
    clock,
    engine,
    sign_in,
)

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
    browser: webdriver.Chrome, server: Server, engine: Engine, clock: Clock
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
    assert not browser.find_elements(By.CSS_SELECTOR, ".pager a[rel=next]")
    _follow(browser, "prev")
    assert _shown_batches(browser) == newest_first[:PAGE]
    assert not browser.find_elements(By.CSS_SELECTOR, ".pager a[rel=prev]")


def test_a_batches_page_link_not_made_by_the_console_is_a_400_page(
    browser: webdriver.Chrome, server: Server
) -> None:
    sign_in(browser, server, READ, "/ui/batches?cursor=eyJrIjoiYmF0Y2hlcyIsImIiOiJ4In0")
    assert "That page link is not valid" in browser.find_element(By.ID, "message").text
