"""Console sessions held on the server (issue 29, Medium 1, and issue 28's sign-out): the key that
signs cookies is a server secret shared through the database, rotating it ends sessions, and
sign-out ends the session for every copy of its cookie. Plain HTTP against the app (no browser):
the browser flows are in test_console.py."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from pydantic import SecretStr
from sqlalchemy import Engine, delete, select

from app.api import create_app
from app.outbox.schema import api_secrets, ui_sessions
from tests.support.api import OPERATOR, READ, client_for, settings_for

ORIGIN = {"Origin": "http://outbox.test"}


@asynccontextmanager
async def console(
    db_url: str, engine: Engine, **settings: object
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a new API process (a replica) on the test's database."""
    async with client_for(create_app(settings_for(db_url, **settings), engine=engine)) as c:
        yield c


async def sign_in(c: httpx.AsyncClient, token: str) -> str:
    r = await c.post("/ui/login", data={"token": token, "next": "/ui"}, headers=ORIGIN)
    assert r.status_code == 303, r.text
    return r.cookies["outbox_session"]


async def page(c: httpx.AsyncClient, cookie: str, path: str = "/ui/audit") -> httpx.Response:
    c.cookies.clear()
    return await c.get(path, headers={"Cookie": f"outbox_session={cookie}"})


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF field on the page"
    return found.group(1)


async def test_a_cookie_copied_before_sign_out_is_refused_after_it(
    db_url: str, engine: Engine
) -> None:
    async with console(db_url, engine) as c, console(db_url, engine) as replica:
        cookie = await sign_in(c, OPERATOR)
        shown = await page(c, cookie)
        assert shown.status_code == 200, shown.text
        copied = cookie  # taken from the browser before sign-out (a shared machine, a proxy log)
        r = await c.post(
            "/ui/logout",
            data={"csrf": csrf_of(shown.text)},
            headers={"Cookie": f"outbox_session={cookie}"},
        )
        assert r.status_code == 303 and r.headers["location"] == "/ui/login"
        for client in (c, replica):  # refused by every replica, not only the one signed out of
            r = await page(client, copied)
            assert r.status_code == 303 and r.headers["location"].startswith("/ui/login"), r.text
        with engine.connect() as conn:
            [row] = conn.execute(select(ui_sessions)).mappings().all()
        assert row["ended_at"] is not None and row["principal"] == "operator-token"
        assert copied not in str(row), "the table holds a hash of the session id, not the id"


async def test_replicas_share_the_generated_secret_and_rotating_it_ends_sessions(
    db_url: str, engine: Engine
) -> None:
    async with console(db_url, engine) as one, console(db_url, engine) as two:
        cookie = await sign_in(one, READ)
        assert (await page(two, cookie)).status_code == 200, "another replica reads the session"
    with engine.connect() as conn:
        [secret] = conn.execute(select(api_secrets.c.value)).scalars().all()
    assert len(secret) == 32 and READ.encode() not in secret
    with engine.begin() as conn:  # rotation of the generated secret: delete it, restart
        conn.execute(delete(api_secrets))
    async with console(db_url, engine) as restarted:
        assert (await page(restarted, cookie)).status_code == 303
        assert (await page(restarted, await sign_in(restarted, READ))).status_code == 200


async def test_a_configured_secret_signs_and_changing_it_ends_sessions(
    db_url: str, engine: Engine
) -> None:
    first, second = SecretStr("a" * 64), SecretStr("b" * 64)
    async with console(db_url, engine, session_secret=first) as c:
        cookie = await sign_in(c, OPERATOR)
    async with console(db_url, engine, session_secret=first) as same:
        assert (await page(same, cookie)).status_code == 200
    async with console(db_url, engine, session_secret=second) as rotated:
        assert (await page(rotated, cookie)).status_code == 303
    with engine.connect() as conn:
        assert conn.execute(select(api_secrets)).first() is None, "nothing generated"


async def test_a_malformed_cookie_is_a_sign_in_page_not_a_500(db_url: str, engine: Engine) -> None:
    """Issue 29, Low: ``Cookie: outbox_session=a.\\xe9`` answered 500 with a traceback."""
    async with console(db_url, engine) as c:
        r = await c.get("/ui/audit", headers={"Cookie": "outbox_session=a.\xe9".encode("latin-1")})
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login")


CROSS_SITE = [
    {"Origin": "https://evil.example"},
    {"Origin": "null"},  # a data: URL or a sandboxed frame
    {"Referer": "https://evil.example/page"},
    {"Origin": "http://outbox.test", "Sec-Fetch-Site": "cross-site"},
]


async def test_a_sign_in_posted_from_another_site_is_refused(db_url: str, engine: Engine) -> None:
    """Issue 29, Medium 3 (login CSRF): any page an operator visited could post the sign-in form,
    signing them in as someone else or spending their address's budget of failures."""
    async with console(db_url, engine) as c:
        for headers in CROSS_SITE:
            r = await c.post("/ui/login", data={"token": OPERATOR, "next": "/ui"}, headers=headers)
            assert r.status_code == 403 and "outbox_session" not in r.cookies, headers
            assert "not sent from this console" in r.text
        for i in range(30):  # wrong tokens from another site spend nobody's budget
            r = await c.post("/ui/login", data={"token": f"wrong-{i}"}, headers=CROSS_SITE[0])
            assert r.status_code == 403
        r = await c.post("/ui/login", data={"token": "wrong"}, headers=ORIGIN)
        assert r.status_code == 401
        assert await sign_in(c, OPERATOR)
        for same in (
            {"Referer": "http://outbox.test/ui/login"},
            {"Sec-Fetch-Site": "same-origin"},
            {},
        ):
            r = await c.post("/ui/login", data={"token": READ}, headers=same)
            assert r.status_code == 303, same
    with engine.connect() as conn:
        assert len(conn.execute(select(ui_sessions)).all()) == 4


async def test_over_its_budget_a_sign_in_cannot_tell_a_right_token_from_a_wrong_one(
    db_url: str, engine: Engine
) -> None:
    """Issue 48, Medium 1: over the budget a wrong token got 429 and the right one 303, so the
    throttle told a guesser which guess was right. Now every sign-in of that address gets the
    same 429 page until the window passes; a session signed in before keeps working."""
    async with console(db_url, engine) as c:
        before = await sign_in(c, READ)
        c.cookies.clear()
        codes = [
            (await c.post("/ui/login", data={"token": f"wrong-{i}"}, headers=ORIGIN)).status_code
            for i in range(25)
        ]
        assert codes == [401] * 20 + [429] * 5
        wrong = await c.post("/ui/login", data={"token": "wrong"}, headers=ORIGIN)
        right = await c.post("/ui/login", data={"token": OPERATOR}, headers=ORIGIN)
        assert right.status_code == wrong.status_code == 429
        assert "outbox_session" not in right.cookies
        assert _without_csrf(right.text) == _without_csrf(wrong.text)
        assert (await page(c, before, "/ui")).status_code == 200, "a live session is not throttled"


def _without_csrf(html: str) -> str:
    return re.sub(r'name="csrf" value="[^"]+"', "", html)
