"""Sign-in and sign-out, and the stylesheet (the pages before a session)."""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials
from starlette.concurrency import run_in_threadpool

from app.api.auth import Role, _has_tokens, role_of
from app.api.console import store
from app.api.console.base import (
    HERE,
    SECURITY_HEADERS,
    ConsoleError,
    log,
    now_ts,
    one,
    page_router,
    read_form,
    render,
    safe_next,
    session_of,
    sessions_of,
    signer_of,
)
from app.api.console.session import COOKIE, COOKIE_PATH
from app.api.context import client_address, get_ctx

router = page_router()


@router.get("/console.css")
def stylesheet() -> Response:
    css = (HERE / "console.css").read_text()
    return PlainTextResponse(css, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


@router.get("/login")
def login_page(request: Request) -> HTMLResponse:
    ctx = get_ctx(request)
    expired = request.query_params.get("expired") == "1"
    return render(
        request,
        "login.html",
        session=None,
        insecure=not _has_tokens(ctx.settings),
        next=safe_next(request.query_params.get("next")),
        message="Your session expired: sign in again." if expired else None,
    )


def _posted_here(request: Request) -> bool:
    """A form posted from this console's own page. A browser names the page that posts (Origin
    on every POST, ``null`` from a data: URL or a sandbox; Referer; Sec-Fetch-Site): another
    site's page must not sign an operator in as someone else (login CSRF), nor spend their
    address's budget of failures. A client that names no page is not a browser on another site."""
    host = request.headers.get("host", "")
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is not None:
        return origin != "null" and urlsplit(origin).netloc == host
    referer = request.headers.get("referer")
    return referer is None or urlsplit(referer).netloc == host


#: What a refused sign-in is told, by why it was refused.
ANOTHER_SITE = (
    "This sign-in was not sent from this console's page: open the console and sign in there."
)
THROTTLED = "Too many failed sign-ins from your address: wait a minute."
WRONG_TOKEN = (
    "That token is not valid here: use OUTBOX_API_TOKEN to look or OUTBOX_OPERATOR_TOKEN to act."
)
METRICS_TOKEN = (
    "This token reads /metrics only: use OUTBOX_API_TOKEN to look or OUTBOX_OPERATOR_TOKEN to act."
)


@router.post("/login")
async def login(request: Request) -> Response:
    ctx = get_ctx(request)
    form = await read_form(request)
    target = safe_next(one(form, "next"))
    client = client_address(request)
    token = (form.get("token") or [""])[0]
    insecure = not _has_tokens(ctx.settings)

    def refused(code: int, message: str) -> Response:
        return render(
            request, "login.html", session=None, code=code, insecure=insecure, next=target,
            message=message,
        )  # fmt: skip

    if not _posted_here(request):
        log.warning("console: sign-in posted from another site refused, from %s", client)
        return refused(403, ANOTHER_SITE)
    try:
        creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)
        role = role_of(ctx.settings, creds if token else None, ctx=ctx, client=client)
    except HTTPException as exc:
        return refused(exc.status_code, THROTTLED if exc.status_code == 429 else WRONG_TOKEN)
    if role < Role.READER:
        log.warning("console: sign-in with the metrics token refused, from %s", client)
        return refused(403, METRICS_TOKEN)
    principal = (
        "anonymous (insecure mode)"
        if insecure
        else "operator-token"
        if role >= Role.OPERATOR
        else "read-token"
    )
    return await _signed_in(request, role, principal, target=target, client=client)


async def _signed_in(
    request: Request, role: Role, principal: str, *, target: str, client: str
) -> Response:
    """A new session: kept on the server, its cookie set, and the browser sent on."""
    signer = await run_in_threadpool(signer_of, request)
    cookie, session = signer.issue(role, principal, now=now_ts(request))
    expires = dt.datetime.fromtimestamp(session.expires, dt.UTC)
    await run_in_threadpool(
        store.open_session,
        sessions_of(request).engine,
        session_id=session.nonce,
        principal=principal,
        expires=expires,
        now=get_ctx(request).now(),
    )
    log.info("console: %s signed in from %s", principal, client)
    response = RedirectResponse(target, 303, headers=SECURITY_HEADERS)
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=session.expires - int(now_ts(request)),
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Sign-out ends the session on the server: a copy of the cookie is refused from now on."""
    session = await run_in_threadpool(session_of, request)
    form = await read_form(request)
    if not signer_of(request).csrf_ok(session, one(form, "csrf")):
        raise ConsoleError(403, "This form was not sent from this console session.")
    await run_in_threadpool(
        store.end_session,
        sessions_of(request).engine,
        session_id=session.nonce,
        now=get_ctx(request).now(),
    )
    response = RedirectResponse("/ui/login", 303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
    return response
