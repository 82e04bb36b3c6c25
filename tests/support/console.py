"""The console tests' shared ground: a headless Chromium, a served console, signing in, the
fixtures (clock, engine) and the helpers that read what a page or an action changed."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy import Engine, select

from app.outbox.records import Backoff, ReturnedRow
from app.outbox.schema import outbox
from app.outbox.states import Status
from tests.support.api import (
    Clock,
    settings_for,
)
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


SHOTS = os.environ.get("CONSOLE_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    if not (shutil.which("chromium") and Path(CHROMEDRIVER).exists()):
        pytest.fail("chromium and chromium-driver are needed (make tools installs them)")
    options = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
    ):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


class Server:
    """``uvicorn`` on a loopback port of its own, in a thread, serving ``create_app``."""

    def __init__(self, engine: Engine, url: str, clock: Clock) -> None:
        from app.api import create_app

        self.app = create_app(settings_for(url), clock=clock, engine=engine)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    from app.db import make_engine

    eng = make_engine(pg_url)
    yield eng
    eng.dispose()


def _gone(element: WebElement) -> bool:
    """The page the element was on has been replaced (Chromium says so in more than one way)."""
    try:
        element.is_enabled()
    except WebDriverException:  # stale, or "does not belong to the document"
        return True
    return False


def submit(
    browser: webdriver.Chrome, by: str, value: str, within: WebElement | None = None
) -> None:
    """Click a submit button and wait for the page the form leads to (a click returns before
    the navigation it starts has finished)."""
    old = browser.find_element(By.TAG_NAME, "html")
    (within or browser).find_element(by, value).click()
    WebDriverWait(browser, 15).until(lambda _b: _gone(old))
    WebDriverWait(browser, 15).until(
        lambda b: b.execute_script("return document.readyState") == "complete"
    )


def sign_in(browser: webdriver.Chrome, server: Server, token: str, path: str = "/ui") -> None:
    browser.delete_all_cookies()
    browser.get(server.base + path)
    assert "/ui/login" in browser.current_url, browser.current_url
    browser.find_element(By.ID, "token").send_keys(token)
    submit(browser, By.ID, "sign-in")


def text(browser: webdriver.Chrome, element_id: str) -> str:
    return str(browser.find_element(By.ID, element_id).text)


def shot(browser: webdriver.Chrome, name: str, tmp: Path) -> None:
    """Every page is captured (a blank or broken render shows); kept in docs/ when asked."""
    target = (Path(SHOTS) if SHOTS else tmp) / f"{name}.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(target)) and target.stat().st_size > 10_000


def _settle(
    repo: OutboxClients,
    engine: Engine,
    *,
    n: int,
    exchange: str,
    routing_key: str,
    batch_id: str,
    outcome: str,
    prefix: str | None = None,
    reason: str = "",
) -> list[str]:
    """``n`` rows written, claimed, published and settled as the publisher settles them."""
    now = repo.db.clock()
    ids = add_rows(
        engine,
        n=n,
        exchange=exchange,
        routing_key=routing_key,
        batch_id=batch_id,
        prefix=prefix,
        created_at=now,
        available_at=now,
    )
    got = repo.store.claim(owner="p1", limit=n, lease_seconds=600)
    assert sorted(r.message_id for r in got) == sorted(ids)
    rows = [r.id for r in got]
    if outcome != "failed":
        repo.store.record_published(
            owner="p1", channel_id=1, tags=[(i, k + 1) for k, i in enumerate(rows)]
        )
    if outcome == "returned":
        repo.store.mark_returned(
            owner="p1", returns=[ReturnedRow(i, 312, "NO_ROUTE") for i in rows]
        )
    elif outcome == "nacked":
        repo.store.retry(
            owner="p1",
            ids=rows,
            error="nacked by broker",
            backoff=Backoff(),
            exhausted=Status.NACKED,
            max_attempts=1,
        )
    else:
        repo.store.mark_failed(owner="p1", ids=rows, reason=reason)
    return ids


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(outbox.c.message_id, outbox.c.status)).tuples().all())


def moved(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {m for m, s in after.items() if s != before[m]}


def confirm(browser: webdriver.Chrome, button: WebElement) -> tuple[str, str]:
    """Preview from ``button``, then confirm: the preview's filter and count."""
    old = browser.find_element(By.TAG_NAME, "html")
    button.click()
    WebDriverWait(browser, 15).until(lambda _b: _gone(old))
    described, count = text(browser, "filter"), text(browser, "count")
    submit(browser, By.ID, "confirm")
    assert text(browser, "done").split(" row")[0].isdigit()
    return described, count
