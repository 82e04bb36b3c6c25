# ruff: noqa: F811 (the console's fixtures, imported from tests.support.console, are parameters)
"""Every republish entry point of the console moves exactly the rows its page showed, and the
failures view adds up to what the database holds (issue #28), in a real Chromium against a real
``uvicorn`` over a real PostgreSQL.

The incident: exchange ``orders`` returns (312 NO_ROUTE) on routing keys ``apac`` (3 rows) and
``latam`` (2 rows) of batch ``orders:7``; exchange ``gone`` is missing, its publishes failed on
four routing keys of batch ``orders:8``; queue ``payments`` is full, two rows nacked in
``orders:7``. The rows reach those states through the repository's own write-back methods.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from sqlalchemy import Engine, func, select

from app.outbox.records import Backoff
from app.outbox.schema import audit, outbox
from app.outbox.states import TERMINAL_FAILURES, Status
from tests.support.api import OPERATOR, READ, Clock
from tests.support.console import (  # noqa: F401 (fixtures)
    Server,
    _gone,
    _settle,
    browser,
    clock,
    confirm,
    engine,
    moved,
    sign_in,
    statuses,
    submit,
    text,
)
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

pytestmark = pytest.mark.browser


class Incident:
    def __init__(self, engine: Engine, clock: Clock) -> None:
        repo = OutboxClients(engine, clock=clock)
        self.apac = _settle(
            repo,
            engine,
            n=3,
            exchange="orders",
            routing_key="apac",
            batch_id="orders:7",
            outcome="returned",
        )
        self.latam = _settle(
            repo,
            engine,
            n=2,
            exchange="orders",
            routing_key="latam",
            batch_id="orders:7",
            outcome="returned",
        )
        self.gone = {
            key: _settle(
                repo,
                engine,
                n=1 + i,
                exchange="gone",
                routing_key=key,
                batch_id="orders:8",
                outcome="failed",
                reason="exchange 'gone' not found (404) past its retry budget",
            )
            for i, key in enumerate(("k1", "k2", "k3", "k4"))
        }
        self.nacked = _settle(
            repo,
            engine,
            n=2,
            exchange="payments",
            routing_key="pay",
            batch_id="orders:7",
            outcome="nacked",
        )


@pytest.fixture
def incident(engine: Engine, clock: Clock) -> Incident:
    found = Incident(engine, clock)
    clock.advance(2)
    return found


@pytest.fixture
def server(pg_url: str, engine: Engine, clock: Clock, incident: Incident) -> Iterator[Server]:
    with Server(engine, pg_url, clock) as srv:
        yield srv


def last_audit_filter(engine: Engine) -> dict[str, object]:
    with engine.connect() as conn:
        doc = conn.execute(select(audit.c.filter).order_by(audit.c.id.desc()).limit(1)).scalar()
    assert isinstance(doc, dict)
    return doc


def test_a_routing_key_of_a_cause_moves_that_key_only(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine
) -> None:
    sign_in(browser, server, OPERATOR, "/ui/failures")
    row = browser.find_element(
        By.CSS_SELECTOR, "#failures tr.key[data-status=returned][data-routing-key=apac]"
    )
    shown = int(row.find_elements(By.TAG_NAME, "td")[4].text)
    before = statuses(engine)
    described, count = confirm(browser, row.find_element(By.CSS_SELECTOR, "button.go"))
    assert "status returned, exchange 'orders', routing key 'apac', reason " in described
    assert count == "3 rows would move back to pending." and shown == 3
    assert moved(before, statuses(engine)) == set(incident.apac)
    assert {statuses(engine)[m] for m in incident.latam} == {"returned"}
    doc = last_audit_filter(engine)
    assert (doc["routing_key"], doc["exchange"], doc["statuses"]) == (
        "apac",
        "orders",
        ["returned"],
    )
    assert doc["cause"] == "returned by broker: 312 NO_ROUTE"


def test_a_cause_is_one_group_and_its_button_moves_the_whole_cause(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine
) -> None:
    sign_in(browser, server, OPERATOR, "/ui/failures")
    group = browser.find_element(By.CSS_SELECTOR, "#failures tr.group[data-exchange=gone]")
    keys = browser.find_elements(By.CSS_SELECTOR, "#failures tr.key[data-exchange=gone]")
    assert [k.get_attribute("data-routing-key") for k in keys] == ["k4", "k3", "k2", "k1"]
    assert [int(k.find_elements(By.TAG_NAME, "td")[4].text) for k in keys] == [4, 3, 2, 1]
    assert int(group.find_elements(By.TAG_NAME, "td")[4].text) == 10
    before = statuses(engine)
    described, count = confirm(browser, group.find_element(By.CSS_SELECTOR, "button.go"))
    assert described.startswith("status failed, exchange 'gone', reason \"exchange 'gone' not")
    assert count == "10 rows would move back to pending."
    assert moved(before, statuses(engine)) == {m for ids in incident.gone.values() for m in ids}


def test_a_search_republishes_the_rows_it_listed(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine
) -> None:
    sign_in(browser, server, OPERATOR, "/ui/messages?status=returned&routing_key=latam")
    listed = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#messages tr.found a")}
    assert listed == set(incident.latam) and text(browser, "total") == "2"
    before = statuses(engine)
    described, count = confirm(
        browser, browser.find_element(By.CSS_SELECTOR, "#search-republish button.go")
    )
    assert described == "status returned, routing key 'latam'"
    assert count == "2 rows would move back to pending."
    assert moved(before, statuses(engine)) == listed


def test_a_search_without_status_republishes_only_its_failures(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine
) -> None:
    sign_in(browser, server, OPERATOR, "/ui/messages?batch_id=orders%3A7&exchange=payments")
    listed = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#messages tr.found a")}
    before = statuses(engine)
    described, _count = confirm(
        browser, browser.find_element(By.CSS_SELECTOR, "#search-republish button.go")
    )
    assert described == "status failed or nacked or returned, batch 'orders:7', exchange 'payments'"
    assert moved(before, statuses(engine)) == listed == set(incident.nacked)


def test_the_batch_page_republishes_the_failures_of_that_batch(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine
) -> None:
    sign_in(browser, server, OPERATOR, "/ui/batches/orders%3A7")
    before = statuses(engine)
    described, count = confirm(browser, browser.find_element(By.CSS_SELECTOR, "button.go"))
    assert described == "status failed or nacked or returned, batch 'orders:7'"
    assert count == "7 rows would move back to pending."
    assert moved(before, statuses(engine)) == {*incident.apac, *incident.latam, *incident.nacked}


def test_the_message_page_republishes_that_message(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine
) -> None:
    target = incident.gone["k3"][1]
    sign_in(browser, server, OPERATOR, "/ui/messages/" + quote(target))
    before = statuses(engine)
    described, count = confirm(browser, browser.find_element(By.CSS_SELECTOR, "button.go"))
    assert described == f"status failed, message {target!r}"
    assert count == "1 row would move back to pending."
    assert moved(before, statuses(engine)) == {target}
    assert last_audit_filter(engine)["message_id"] == target
    browser.get(server.base + "/ui/messages/" + quote(target))
    assert "republish" in text(browser, "actions")
    browser.get(server.base + "/ui/messages/" + quote(incident.gone["k3"][0]))  # its neighbour
    assert text(browser, "actions").endswith("None.")


def test_failure_totals_equal_the_database_on_every_page(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine, clock: Clock
) -> None:
    repo = OutboxClients(engine, clock=clock)
    for i in range(55):  # 55 more causes: 58 in all, two pages of 50
        _settle(
            repo,
            engine,
            n=1,
            exchange="x",
            routing_key="rk",
            batch_id="orders:9",
            outcome="failed",
            reason=f"cause number {i:02d}",
        )
    with engine.connect() as conn:
        terminal = outbox.c.status.in_([s.value for s in TERMINAL_FAILURES])
        in_sql = conn.execute(select(func.count()).where(terminal)).scalar_one()
    sign_in(browser, server, READ, "/ui/failures")
    assert int(text(browser, "total-rows")) == in_sql == 72
    assert int(text(browser, "total-groups")) == 58
    counted, pages = 0, 0
    while True:
        pages += 1
        for g in browser.find_elements(By.CSS_SELECTOR, "#failures tr.group"):
            counted += int(g.find_elements(By.TAG_NAME, "td")[4].text)
        nxt = browser.find_elements(By.ID, "next")
        if not nxt:
            break
        submit_link(browser, nxt[0])
    assert (counted, pages) == (in_sql, 2)
    assert "Page 2 of 2" in text(browser, "pager")


def submit_link(browser: webdriver.Chrome, link: WebElement) -> None:
    href = link.get_attribute("href")
    assert href
    browser.get(href)


@pytest.mark.parametrize("path", ["/ui/messages/%00", "/ui/batches/%00", "/ui/batches/a%00b"])
def test_a_nul_in_an_id_is_a_400_console_page(
    server: Server, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=server.base, timeout=15) as client:
        client.post("/ui/login", data={"token": READ})
        r = client.get(path)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("text/html")
    assert "cannot hold a NUL character" in r.text and "Traceback" not in r.text
    assert "Sign out" in r.text  # the console's navigation, signed in
    assert not any("\x00" in rec.getMessage() for rec in caplog.records)


def test_an_unknown_console_path_is_a_404_console_page(
    browser: webdriver.Chrome, server: Server
) -> None:
    sign_in(browser, server, READ, "/ui")
    for path in ("/ui/nope", "/ui/messages/a/b", "/ui/failures/x"):
        browser.get(server.base + path)
        assert text(browser, "message") == (
            "There is no such console page: start from the overview."
        ), path
    r = httpx.get(server.base + "/ui/nope", timeout=15)
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")


def test_the_history_of_a_message_keeps_every_fact_in_the_broker_s_words(
    browser: webdriver.Chrome, server: Server, incident: Incident, engine: Engine, clock: Clock
) -> None:
    """Failed twice (404), republished from its page, then published and confirmed: all of it
    shows, in order; a returned row says the broker returned it, then acked."""
    repo = OutboxClients(engine, clock=clock)
    (mid,) = add_rows(engine, n=1, exchange="gone", created_at=clock.now, available_at=clock.now)
    retry = {
        "owner": "p1",
        "error": "exchange 'gone' not found (404)",
        "max_attempts": 2,
        "backoff": Backoff(base=0.01, cap=0.01),
        "exhausted": Status.FAILED,
    }
    for _ in range(2):
        clock.advance(1)
        (row,) = repo.store.claim(owner="p1", limit=1, lease_seconds=60)
        repo.store.retry(ids=[row.id], **retry)  # type: ignore[arg-type]
    sign_in(browser, server, OPERATOR, "/ui/messages/" + quote(mid))
    confirm(browser, browser.find_element(By.CSS_SELECTOR, "button.go"))
    clock.advance(1)
    (row,) = repo.store.claim(owner="p1", limit=1, lease_seconds=60)
    repo.store.record_published(owner="p1", channel_id=4, tags=[(row.id, 9)])
    clock.advance(1)
    repo.store.mark_confirmed(owner="p1", ids=[row.id])
    browser.get(server.base + "/ui/messages/" + quote(mid))
    steps = [
        r.find_elements(By.TAG_NAME, "td")[1].text
        for r in browser.find_elements(By.CSS_SELECTOR, "#history tr")
    ]
    assert steps == [
        "written to the outbox",
        "attempt 1 failed: exchange 'gone' not found (404); retried after a backoff",
        "attempt 2 failed for good: exchange 'gone' not found (404)",
        "republished by operator-token (audit #1): it was failed (exchange 'gone' not found "
        "(404)); back to pending, attempts from 0",
        "claimed by a publisher (attempt 1 of 10)",
        "published to 'gone' on channel 4, delivery tag 9",
        "confirmed by the broker (ack)",
    ], steps

    browser.get(server.base + "/ui/messages/" + quote(incident.apac[0]))
    history = text(browser, "history")
    assert "attempt 1: the broker returned it as unroutable (312 NO_ROUTE), then acked" in history
    assert "confirmed by the broker" not in history


@pytest.mark.parametrize("page", ["999999999999999999", "184467440737095517"])
def test_a_page_past_any_outbox_is_a_404_console_page(
    server: Server, page: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 48: the offset of ``/ui/failures?page=999999999999999999`` overflowed PostgreSQL's
    bigint before the page count was checked: a 500, and the SQL with its parameters logged."""
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=server.base, timeout=15) as client:
        client.post("/ui/login", data={"token": READ})
        r = client.get("/ui/failures", params={"page": page})
    assert r.status_code == 404, r.text
    assert f"There is no page {page} of the failures" in r.text and "Traceback" not in r.text
    assert not any("OFFSET" in rec.getMessage().upper() for rec in caplog.records)
