# ruff: noqa: F811 (the console's fixtures, imported from tests.support.console, are parameters)
"""The web console (``/ui``) in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``), against a real ``uvicorn`` serving the API on loopback over a real
PostgreSQL database seeded with rows in every state.

Pages render for the read token; the read token cannot republish (no button, and the server
refuses a forged attempt); the operator republishes from the failures view through a dry-run
preview and an explicit confirmation, the rows move and the audit row names who and from where;
bad input (a wrong token, an expired session, a form without its CSRF token, a form posted from
another site, a filter matching nothing, an invalid filter) each shows a clear message.

``CONSOLE_SCREENSHOTS=docs/console pytest tests/integration/test_console.py`` refreshes the
screenshots in docs/.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from sqlalchemy import Engine

from tests.support.api import (
    OPERATOR,
    READ,
    Clock,
    Seeded,
    audit_rows,
    seed_every_state,
    statuses_of,
)
from tests.support.console import (  # noqa: F401 (fixtures)
    Server,
    _gone,
    browser,
    clock,
    engine,
    shot,
    sign_in,
    submit,
    text,
)

pytestmark = pytest.mark.browser


@pytest.fixture
def seeded(engine: Engine, clock: Clock) -> Seeded:
    s = seed_every_state(engine, clock)
    clock.advance(2)
    return s


@pytest.fixture
def server(pg_url: str, engine: Engine, clock: Clock, seeded: Seeded) -> Iterator[Server]:
    with Server(engine, pg_url, clock) as srv:
        yield srv


def test_every_page_renders_for_the_read_token_which_cannot_republish(
    browser: webdriver.Chrome, server: Server, seeded: Seeded, engine: Engine, tmp_path: Path
) -> None:
    sign_in(browser, server, READ, "/ui/failures")
    assert browser.current_url == server.base + "/ui/failures"  # back where it was asked for
    assert "read-token (read only)" in text(browser, "who")
    groups = browser.find_elements(By.CSS_SELECTOR, "#failures tr.group")
    causes = {tuple(g.find_elements(By.TAG_NAME, "td")[i].text for i in (0, 1, 3)) for g in groups}
    assert causes == {
        ("returned", "orders", "returned by broker: 312 NO_ROUTE"),
        ("nacked", "payments", "nacked by broker"),
        ("failed", "orders", "body too large"),
    }, causes
    assert not browser.find_elements(By.CSS_SELECTOR, "button.go"), "no republish for readers"

    browser.get(server.base + "/ui")
    assert text(browser, "verdict").startswith("CRITICAL") or "WARNING" in text(browser, "verdict")
    assert text(browser, "count-nacked") == "2" and text(browser, "count-in_flight") == "4"
    assert text(browser, "alive") == "1 of 2 known"
    assert text(browser, "duplicates") == "1"
    # PostgreSQL's figures of the table (its counters lag the seed by up to a second)
    assert re.fullmatch(
        r"[\d,]+ live rows, [\d,]+ dead · [\d,]+ MB with its indexes · (vacuumed .+ ago|never "
        r"vacuumed)( \(a vacuum runs now\))?",
        text(browser, "table-upkeep"),
    ), text(browser, "table-upkeep")
    shot(browser, "overview", tmp_path)
    for path, table, name in [
        ("/ui/batches", "batches", "batches"),
        ("/ui/outstanding", "outstanding", "outstanding"),
        ("/ui/failures", "failures", "failures"),
        ("/ui/messages?status=returned", "messages", "messages"),
        ("/ui/audit", "audit", "audit"),
    ]:
        browser.get(server.base + path)
        assert browser.find_element(By.ID, table).is_displayed(), path
        shot(browser, name, tmp_path)
    browser.get(server.base + "/ui/outstanding")
    rows = browser.find_elements(By.CSS_SELECTOR, "#outstanding tr")[1:]
    assert len(rows) == 4 and sum("not sent" in r.text for r in rows) == 1  # claimed only

    browser.get(server.base + "/ui/messages/" + seeded["nacked"][0])
    assert text(browser, "status") == "nacked"
    history = text(browser, "history")
    assert "published to 'payments' on channel 1, delivery tag 6" in history
    assert "nacked by broker" in history
    shot(browser, "message", tmp_path)

    # no button, and the server refuses the form anyway
    browser.get(server.base + "/ui/republish")
    submit(browser, By.ID, "preview")
    assert "needs the operator token" in text(browser, "message")
    assert audit_rows(engine) == []
    assert set(statuses_of(engine, seeded["nacked"]).values()) == {"nacked"}


def test_the_operator_republishes_from_the_failures_view_with_preview_and_audit(
    browser: webdriver.Chrome, server: Server, seeded: Seeded, engine: Engine, tmp_path: Path
) -> None:
    sign_in(browser, server, OPERATOR, "/ui/failures")
    group = next(
        g
        for g in browser.find_elements(By.CSS_SELECTOR, "#failures tr.group")
        if g.text.startswith("nacked")
    )
    submit(browser, By.CSS_SELECTOR, "button.go", within=group)
    assert "status nacked, exchange 'payments'" in text(browser, "filter")
    assert text(browser, "count") == "2 rows would move back to pending."
    assert set(statuses_of(engine, seeded["nacked"]).values()) == {"nacked"}  # a dry run
    shot(browser, "republish-preview", tmp_path)
    hidden = browser.find_elements(By.CSS_SELECTOR, "form.stack input[type=hidden]")
    confirmation = [(i.get_attribute("name"), i.get_attribute("value")) for i in hidden]
    browser.find_element(By.ID, "actor").send_keys("alice")
    submit(browser, By.ID, "confirm")
    done = text(browser, "done")
    assert done.startswith("2 rows moved back to pending"), done
    shot(browser, "republish-done", tmp_path)
    assert set(statuses_of(engine, seeded["nacked"]).values()) == {"pending"}
    (row,) = audit_rows(engine)
    assert (row["actor"], row["principal"], row["client_addr"], row["count"]) == (
        "alice",
        "operator-token",
        "127.0.0.1",
        2,
    )
    assert f"#{row['id']}" in done

    # the same confirmation sent again (a double click, a resubmitted page): replayed
    cookie = {"outbox_session": str(browser.get_cookie("outbox_session")["value"])}  # type: ignore[index]
    again = httpx.post(
        server.base + "/ui/republish",
        content=urlencode([*confirmation, ("actor", "alice")]),
        headers={"content-type": "application/x-www-form-urlencoded"},
        cookies=cookie,
        timeout=15,
    )
    assert again.status_code == 200 and "Already done with this request id: 2 rows" in again.text
    assert len(audit_rows(engine)) == 1
    # the name for the audit row is untrusted text: a NUL (PostgreSQL's text refuses it), a
    # forged log line or an overlong name is refused with a message, and nothing is written
    for n, bad in enumerate(("al\x00ice", "alice\nconsole: republish forged", "a" * 65)):
        fresh = [(k, f"ui-bad-actor-{n}" if k == "request_id" else v) for k, v in confirmation]
        refused = httpx.post(
            server.base + "/ui/republish",
            content=urlencode([*fresh, ("actor", bad)]),
            headers={"content-type": "application/x-www-form-urlencoded"},
            cookies=cookie,
            timeout=15,
        )
        assert refused.status_code == 400, (bad, refused.status_code)
        assert "must be one line of at most 64 characters" in refused.text
    assert len(audit_rows(engine)) == 1

    browser.get(server.base + "/ui/audit")
    entry = browser.find_element(By.CSS_SELECTOR, "#audit tr.entry").text
    assert "alice" in entry and "operator-token" in entry and "republish" in entry


def test_bad_input_gets_a_clear_message_and_changes_nothing(
    browser: webdriver.Chrome, server: Server, seeded: Seeded, engine: Engine, clock: Clock
) -> None:
    before = statuses_of(engine, [m for ids in seeded.ids.values() for m in ids])
    # a wrong token
    browser.delete_all_cookies()
    browser.get(server.base + "/ui/login")
    browser.find_element(By.ID, "token").send_keys("not-a-token-of-this-api-at-all")
    submit(browser, By.ID, "sign-in")
    assert "not valid here" in text(browser, "message")
    assert browser.get_cookie("outbox_session") is None

    # a filter matching nothing, then an invalid one
    sign_in(browser, server, OPERATOR, "/ui/republish")
    browser.find_element(By.NAME, "exchange").send_keys("no-such-exchange")
    submit(browser, By.ID, "preview")
    assert text(browser, "nothing") == "No row matches this filter: nothing to republish."
    assert not browser.find_elements(By.ID, "confirm")
    browser.get(server.base + "/ui/republish")
    browser.find_element(By.NAME, "created_after").send_keys("2030-01-02T00:00:00Z")
    browser.find_element(By.NAME, "created_before").send_keys("2030-01-01T00:00:00Z")
    submit(browser, By.ID, "preview")
    assert "created_after must be earlier than created_before" in text(browser, "message")

    # a form without its CSRF token (removed from the page before submitting)
    browser.get(server.base + "/ui/republish")
    try:
        browser.execute_script("document.querySelector('form.stack input[name=csrf]').remove()")
    except WebDriverException as exc:  # pragma: no cover - a CSP that blocks WebDriver scripts
        pytest.fail(f"could not edit the form: {exc}")
    submit(browser, By.ID, "preview")
    assert "CSRF token is missing or stale" in text(browser, "message")

    # a form posted from another site: the SameSite=Strict cookie stays home, no session
    forged = (
        f"<form method=post action='{server.base}/ui/republish/preview'>"
        "<input name=all value=yes><button id=go>go</button></form>"
    )
    browser.get("data:text/html," + forged)
    submit(browser, By.ID, "go")
    assert "/ui/login" in browser.current_url

    # a sign-in posted from another site (login CSRF): refused, no session set
    browser.delete_all_cookies()
    forged = (
        f"<form method=post action='{server.base}/ui/login'><input name=token "
        f"value={OPERATOR}><button id=go>go</button></form>"
    )
    browser.get("data:text/html," + forged)
    submit(browser, By.ID, "go")
    assert "not sent from this console" in text(browser, "message")
    assert browser.get_cookie("outbox_session") is None

    # an expired session: sent back to sign in, told why, then back where it was
    sign_in(browser, server, READ, "/ui/audit")
    clock.advance(dt.timedelta(hours=9).total_seconds())
    browser.get(server.base + "/ui/batches")
    assert "/ui/login" in browser.current_url
    assert text(browser, "message") == "Your session expired: sign in again."
    browser.find_element(By.ID, "token").send_keys(READ)
    submit(browser, By.ID, "sign-in")
    assert browser.current_url == server.base + "/ui/batches"

    assert statuses_of(engine, list(before)) == before
    assert audit_rows(engine) == []
