# ruff: noqa: F811 (the console's fixtures, imported from tests.support.console, are parameters)
"""The whole incident in the console (issue #28), in a real Chromium over a real PostgreSQL:
parked ordering keys with republish and skip, a dead publisher's holdings with when they return
to pending, a message body escaped and cut, times with their zone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from sqlalchemy import Engine, select

from app.outbox.records import Backoff
from app.outbox.schema import audit, outbox
from app.outbox.states import Status
from tests.support.api import OPERATOR, READ, Clock
from tests.support.console import (  # noqa: F401 (fixtures)
    Server,
    browser,
    clock,
    confirm,
    engine,
    moved,
    shot,
    sign_in,
    statuses,
    submit,
    text,
)
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

pytestmark = pytest.mark.browser


class Parked:
    """Keys ``k-1`` and ``k-2``, three rows each; each key's first row nacked for good."""

    def __init__(self, engine: Engine, clock: Clock) -> None:
        repo = OutboxClients(engine, clock=clock)
        self.rows = {
            key: add_rows(
                engine,
                n=3,
                prefix=key,
                ordering_key=key,
                created_at=clock.now,
                available_at=clock.now,
            )
            for key in ("k-1", "k-2")
        }
        heads = repo.store.claim(owner="p1", limit=10, lease_seconds=60)
        assert sorted(r.message_id for r in heads) == ["k-1-0", "k-2-0"]  # the rest wait
        repo.store.retry(
            owner="p1",
            ids=[r.id for r in heads],
            error="nacked by the broker",
            backoff=Backoff(),
            exhausted=Status.NACKED,
            max_attempts=1,
        )


@pytest.fixture
def parked(engine: Engine, clock: Clock) -> Parked:
    found = Parked(engine, clock)
    clock.advance(30)
    return found


@pytest.fixture
def server(pg_url: str, engine: Engine, clock: Clock, parked: Parked) -> Iterator[Server]:
    with Server(engine, pg_url, clock) as srv:
        yield srv


def test_parked_keys_show_and_resume_by_republish_or_skip(
    browser: webdriver.Chrome, server: Server, parked: Parked, engine: Engine, tmp_path: Path
) -> None:
    sign_in(browser, server, OPERATOR, "/ui")
    assert text(browser, "parked-keys") == "2: resume or skip them"
    browser.get(server.base + "/ui/parked")
    rows = browser.find_elements(By.CSS_SELECTOR, "#parked tr.parked")
    shown = [
        [td.text for td in r.find_elements(By.TAG_NAME, "td")[:3]]
        + [r.find_elements(By.TAG_NAME, "td")[5].text]
        for r in rows
    ]
    assert shown == [["k-1", "k-1-0", "nacked", "2"], ["k-2", "k-2-0", "nacked", "2"]]
    assert "UTC (30.0 s ago)" in rows[0].text
    shot(browser, "parked", tmp_path)

    before = statuses(engine)
    described, count = confirm(browser, rows[0].find_element(By.CSS_SELECTOR, "button.go"))
    assert described == "status failed or nacked or returned, ordering key 'k-1'"
    assert count == "1 row would move back to pending."
    assert moved(before, statuses(engine)) == {"k-1-0"}

    browser.get(server.base + "/ui/parked")
    (row,) = browser.find_elements(By.CSS_SELECTOR, "#parked tr.parked")
    row.find_element(By.NAME, "reason").send_keys("order 2 replaced it")
    submit(browser, By.CSS_SELECTOR, "button.act", within=row)
    assert "2 rows of its ordering key k-2 waiting behind it go on" in text(browser, "done")
    assert statuses(engine)["k-2-0"] == "skipped"
    with engine.connect() as conn:
        last = conn.execute(select(audit).order_by(audit.c.id.desc()).limit(1)).mappings().one()
    assert (last["action"], last["principal"]) == ("skip", "operator-token")
    assert last["filter"] == {"message_id": "k-2-0", "reason": "order 2 replaced it"}
    browser.get(server.base + "/ui/parked")
    assert text(browser, "parked").endswith("No ordering key is parked.")


def test_the_read_token_cannot_skip(
    browser: webdriver.Chrome, server: Server, parked: Parked, engine: Engine
) -> None:
    sign_in(browser, server, READ, "/ui/parked")
    assert not browser.find_elements(By.CSS_SELECTOR, "#parked form")
    assert statuses(engine)["k-1-0"] == "nacked"


def test_a_dead_publisher_s_holdings_say_when_they_return_to_pending(
    browser: webdriver.Chrome, server: Server, parked: Parked, engine: Engine, clock: Clock
) -> None:
    repo = OutboxClients(engine, clock=clock)
    repo.registry.register_publisher(publisher_id="p0", stale_after=30)
    add_rows(engine, n=1, prefix="held", created_at=clock.now, available_at=clock.now)
    (held,) = repo.store.claim(owner="p0", limit=1, lease_seconds=600)
    clock.advance(120)  # p0 beats no more: dead after 3 heartbeat intervals
    repo.registry.register_publisher(publisher_id="p2", stale_after=30)
    add_rows(engine, n=1, prefix="live", created_at=clock.now, available_at=clock.now)
    (live,) = repo.store.claim(owner="p2", limit=1, lease_seconds=600)
    sign_in(browser, server, READ, "/ui/outstanding")
    holders = {
        r.find_element(By.TAG_NAME, "a").text: r.find_element(By.CLASS_NAME, "holder").text
        for r in browser.find_elements(By.CSS_SELECTOR, "#outstanding tr")[1:]
    }
    assert holders[held.message_id] == "dead: back to pending in 8 min"
    assert holders[live.message_id] == "alive"


def test_the_body_is_shown_escaped_and_cut(
    browser: webdriver.Chrome, server: Server, engine: Engine, clock: Clock
) -> None:
    hostile = b"<script>document.title='owned'</script>" + b"x" * 5000
    (mid,) = add_rows(engine, n=1, body=hostile, created_at=clock.now)
    (binary,) = add_rows(engine, n=1, body=bytes(range(256)) * 2, created_at=clock.now)
    sign_in(browser, server, READ, "/ui/messages/" + quote(mid))
    body = text(browser, "body")
    assert body.startswith("<script>document.title='owned'</script>xxx") and len(body) == 4096
    assert "cut at 4096 characters of 5039 bytes" in text(browser, "message-fields")
    assert "owned" not in browser.title
    browser.get(server.base + "/ui/messages/" + quote(binary))
    assert text(browser, "body").startswith("00 01 02 03")
    assert "binary, in hex" in text(browser, "message-fields")
    with engine.connect() as conn:
        assert conn.execute(select(outbox.c.body).where(outbox.c.message_id == mid)).scalar() == (
            hostile
        )
