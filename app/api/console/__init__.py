"""The web console, ``/ui``: server-rendered pages (Jinja2, no JavaScript) over the same queries
and the same audited republish as the REST API.

Sign-in takes a token once and sets a session cookie (:mod:`app.api.console.session`); the read
token sees every page, the operator token also republishes. A republish is always a dry run
first (count and sample), then an explicit confirmation that carries a request id chosen at
preview time: pressing it twice replays the first result instead of moving rows again.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials
from jinja2 import Environment, FileSystemLoader, select_autoescape
from pydantic import ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError, ProgrammingError
from starlette.concurrency import run_in_threadpool

from app.api.auth import Role, _has_tokens, role_of
from app.api.console import store
from app.api.console.session import COOKIE, COOKIE_PATH, Session, SessionError, SessionSigner
from app.api.context import client_address, get_ctx
from app.api.models import RepublishRequest
from app.outbox import health, queries
from app.outbox.repository import (
    MAX_ACTOR,
    MAX_REASON,
    CannotSkip,
    RequestIdReused,
    has_control_characters,
)
from app.outbox.scope import CAUSE_LENGTH, CRITERIA, Scope, ScopeError
from app.outbox.states import TERMINAL_FAILURES, Status

log = logging.getLogger("app.api.console")
HERE = Path(__file__).resolve().parent
MAX_FIELD = 1000
NONE = "\N{EN DASH}"
STALE_FORM = ("This form was not sent from this console session (its CSRF token is missing or "
              "stale). Reload the page and try again.")  # fmt: skip
PAGE = 50
#: Most rows one confirmation moves (the rest: "continue" on the result page, a new request id)
CHUNK = 10_000
REPUBLISH_STATUSES = ("failed", "nacked", "returned")
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}


class ConsoleError(Exception):
    """A page that cannot be shown, with the reason a person reads (and an HTTP status)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class LoginRequired(Exception):
    def __init__(self, target: str, message: str, *, expired: bool) -> None:
        super().__init__(message)
        self.target = target
        self.message = message
        self.expired = expired


class ConsoleRoute(APIRoute):
    """A database that is down or not migrated is an HTML page here, not a JSON problem."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (OperationalError, InterfaceError) as exc:
                log.warning("console: database unavailable: %s", type(exc).__name__)
                message = f"The database is unavailable ({type(exc).__name__}); try again."
                return _error_page(request, 503, message)
            except ProgrammingError:
                return _error_page(request, 503, "The database schema is missing or outdated: "
                                   "run `outbox migrate`.")  # fmt: skip

        return guarded


router = APIRouter(prefix="/ui", include_in_schema=False, route_class=ConsoleRoute)
env = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return NONE
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _when(value: dt.datetime | None) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else NONE


def _ago(value: dt.datetime | None, now: dt.datetime) -> str:
    """How long ago (or, for a time to come, in how long), in words."""
    if value is None:
        return NONE
    seconds = (now - value).total_seconds()
    return f"{_age(seconds)} ago" if seconds >= 0 else f"in {_age(-seconds)}"


env.filters.update(age=_age, when=_when, ago=_ago, query=lambda d: urlencode(d, doseq=True))


# ------------------------------------------------------------------------------ plumbing


def install(app: FastAPI) -> None:
    ctx = app.state.ctx
    app.state.console_sessions = store.ConsoleSessions(ctx.settings, ctx.engine)
    app.include_router(router)
    app.add_exception_handler(LoginRequired, _to_login)
    app.add_exception_handler(ConsoleError, _console_error)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui", 307)


def _sessions(request: Request) -> store.ConsoleSessions:
    sessions: store.ConsoleSessions = request.app.state.console_sessions
    return sessions


def _signer(request: Request) -> SessionSigner:
    """The session signer (its secret read from the database on first use: call from a
    worker thread)."""
    return _sessions(request).signer(now=get_ctx(request).now())


def _now(request: Request) -> float:
    return get_ctx(request).now().timestamp()


def _session(request: Request) -> Session:
    """The request's live session (its cookie checked, then its row: blocking I/O, call from a
    worker thread); :class:`LoginRequired` otherwise."""
    try:
        session = _signer(request).read(request.cookies.get(COOKIE), now=_now(request))
        if not store.session_live(_sessions(request).engine, session_id=session.nonce,
                                  now=get_ctx(request).now()):  # fmt: skip
            raise SessionError("the session ended (signed out on the server): sign in again")
        return session
    except SessionError as exc:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target, str(exc), expired=exc.expired) from None


def render(
    request: Request, template: str, *, session: Session | None, code: int = 200,
    **values: Any,
) -> HTMLResponse:  # fmt: skip
    csrf = _signer(request).csrf(session) if session else ""
    values.setdefault("now", get_ctx(request).now())
    html = env.get_template(template).render(session=session, csrf=csrf, path=request.url.path,
                                             **values)  # fmt: skip
    return HTMLResponse(html, code, headers=SECURITY_HEADERS)


def _error_page(request: Request, status: int, message: str) -> HTMLResponse:
    """An error page, with the navigation of the cookie's session if it has one (read without
    the database, which may be why the page is shown: any action checks the session in full)."""
    signer = _sessions(request).loaded()
    try:
        cookie = request.cookies.get(COOKIE)
        session = signer.read(cookie, now=_now(request)) if signer and cookie else None
    except SessionError:
        session = None
    return render(request, "error.html", session=session, code=status, message=message)


async def _console_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ConsoleError)
    return _error_page(request, exc.status, exc.message)


async def _to_login(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    query = {"next": exc.target, **({"expired": "1"} if exc.expired else {})}
    return RedirectResponse(f"/ui/login?{urlencode(query)}", 303, headers=SECURITY_HEADERS)


def _safe_next(target: str | None) -> str:
    """Only a console path: never an open redirect to another site."""
    if target and target.startswith("/ui") and not target.startswith("//"):
        return target
    return "/ui"


async def _form(request: Request) -> dict[str, list[str]]:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise ConsoleError(415, "Send the form as application/x-www-form-urlencoded.")
    try:
        text = (await request.body()).decode("utf-8")
        return parse_qs(text, keep_blank_values=True, max_num_fields=64)
    except (UnicodeDecodeError, ValueError):
        raise ConsoleError(
            400, "The form could not be read (not UTF-8, or too many fields)."
        ) from None


def _one(form: Mapping[str, list[str]], name: str) -> str | None:
    values = form.get(name) or [""]
    value = values[0].strip()
    if len(value) > MAX_FIELD:
        raise ConsoleError(400, f"The field {name!r} is longer than {MAX_FIELD} characters.")
    return value or None


def _actor(form: Mapping[str, list[str]], session: Session) -> str:
    """Who acted, for the audit row: the name typed in, else the signed-in token's name. A
    name is one line (a NUL would fail the audit row's write on PostgreSQL; other control
    characters would forge lines in the log)."""
    value = _one(form, "actor")
    if value is None:
        return session.principal
    if len(value) > MAX_ACTOR or has_control_characters(value):
        raise ConsoleError(400, f"Your name for the audit row must be one line of at most "
                           f"{MAX_ACTOR} characters, without control characters.")  # fmt: skip
    return value


def _param(request: Request, name: str) -> str | None:
    value = (request.query_params.get(name) or "").strip()
    if len(value) > MAX_FIELD:
        raise ConsoleError(400, f"The parameter {name!r} is longer than {MAX_FIELD} characters.")
    if "\x00" in value:
        raise ConsoleError(400, f"The parameter {name!r} holds a NUL character.")
    return value or None


def _int_param(request: Request, name: str) -> int | None:
    value = _param(request, name)
    if value is None:
        return None
    if not value.isdigit() or len(value) > 18:
        raise ConsoleError(400, f"The parameter {name!r} must be a whole number.")
    return int(value)


async def _acting(request: Request) -> tuple[Session, dict[str, list[str]]]:
    """A state-changing form: a session, its CSRF token, and the operator role."""
    session = await run_in_threadpool(_session, request)
    form = await _form(request)
    if not _signer(request).csrf_ok(session, _one(form, "csrf")):
        log.warning("console: form without a valid CSRF token from %s", client_address(request))
        raise ConsoleError(403, STALE_FORM)
    if not session.can_act:
        raise ConsoleError(403, "Republish needs the operator token: you signed in with the "
                           "read token, which can look but not act.")  # fmt: skip
    return session, form


# ------------------------------------------------------------------------------ sign-in


@router.get("/console.css")
def stylesheet() -> Response:
    css = (HERE / "console.css").read_text()
    return PlainTextResponse(css, media_type="text/css",
                             headers={"Cache-Control": "max-age=3600"})  # fmt: skip


@router.get("/login")
def login_page(request: Request) -> HTMLResponse:
    ctx = get_ctx(request)
    expired = request.query_params.get("expired") == "1"
    return render(request, "login.html", session=None, insecure=not _has_tokens(ctx.settings),
                  next=_safe_next(request.query_params.get("next")),
                  message="Your session expired: sign in again." if expired else None)  # fmt: skip


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


@router.post("/login")
async def login(request: Request) -> Response:
    ctx = get_ctx(request)
    form = await _form(request)
    target = _safe_next(_one(form, "next"))
    client = client_address(request)
    token = (form.get("token") or [""])[0]
    insecure = not _has_tokens(ctx.settings)
    if not _posted_here(request):
        log.warning("console: sign-in posted from another site refused, from %s", client)
        return render(request, "login.html", session=None, code=403, insecure=insecure,
                      next=target, message="This sign-in was not sent from this console's page: "
                      "open the console and sign in there.")  # fmt: skip
    try:
        creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)
        role = role_of(ctx.settings, creds if token else None, ctx=ctx, client=client)
    except HTTPException as exc:
        message = ("Too many failed sign-ins from your address: wait a minute."
                   if exc.status_code == 429 else
                   "That token is not valid here: use OUTBOX_API_TOKEN to look or "
                   "OUTBOX_OPERATOR_TOKEN to act.")  # fmt: skip
        return render(request, "login.html", session=None, code=exc.status_code,
                      insecure=insecure, next=target, message=message)  # fmt: skip
    principal = ("anonymous (insecure mode)" if insecure else
                 "operator-token" if role >= Role.OPERATOR else "read-token")  # fmt: skip
    signer = await run_in_threadpool(_signer, request)
    cookie, session = signer.issue(role, principal, now=_now(request))
    expires = dt.datetime.fromtimestamp(session.expires, dt.UTC)
    await run_in_threadpool(store.open_session, _sessions(request).engine,
                            session_id=session.nonce, principal=principal, expires=expires,
                            now=ctx.now())  # fmt: skip
    log.info("console: %s signed in from %s", principal, client)
    response = RedirectResponse(target, 303, headers=SECURITY_HEADERS)
    response.set_cookie(COOKIE, cookie, max_age=session.expires - int(_now(request)),
                        path=COOKIE_PATH, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")  # fmt: skip
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Sign-out ends the session on the server: a copy of the cookie is refused from now on."""
    session = await run_in_threadpool(_session, request)
    form = await _form(request)
    if not _signer(request).csrf_ok(session, _one(form, "csrf")):
        raise ConsoleError(403, "This form was not sent from this console session.")
    await run_in_threadpool(store.end_session, _sessions(request).engine,
                            session_id=session.nonce, now=get_ctx(request).now())  # fmt: skip
    response = RedirectResponse("/ui/login", 303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
    return response


# ------------------------------------------------------------------------------ pages


@router.get("")
def overview(request: Request) -> HTMLResponse:
    session = _session(request)
    ctx = get_ctx(request)
    stats = queries.read_stats(
        ctx.engine, now=ctx.now(), alive_after=ctx.alive_after,
        latency_window=dt.timedelta(seconds=ctx.settings.stats_latency_window),
        latency_rows=ctx.settings.stats_latency_rows,
    )  # fmt: skip
    parked_keys = len(queries.parked_keys(ctx.engine, limit=101))
    return render(request, "overview.html", session=session, stats=stats,
                  verdict=health.verdict(stats), statuses=list(Status), parked_keys=parked_keys,
                  failures=sum(stats.counts.get(s, 0) for s in TERMINAL_FAILURES))  # fmt: skip


@router.get("/batches")
def batches(request: Request) -> HTMLResponse:
    session = _session(request)
    ctx = get_ctx(request)
    status = _status_param(request)
    cursor = _param(request, "cursor")
    try:
        after = queries.decode_batch_cursor(cursor) if cursor else None
    except queries.BadCursor:
        raise ConsoleError(400, "That page link is not valid: start from the first page.") from None
    page = queries.list_batches(ctx.engine, limit=PAGE, after=after, status=status)
    return render(request, "batches.html", session=session, page=page, status=status,
                  statuses=list(Status))  # fmt: skip


@router.get("/batches/{batch_id}")
def batch(request: Request, batch_id: str) -> HTMLResponse:
    session = _session(request)
    _path_id(batch_id, "batch id")
    found = queries.batch_summary(get_ctx(request).engine, batch_id=batch_id[:MAX_FIELD])
    if found is None:
        raise ConsoleError(404, f"There is no batch {batch_id!r}.")
    failures = sum(found.counts.get(s, 0) for s in TERMINAL_FAILURES)
    return render(request, "batch.html", session=session, b=found, failures=failures,
                  statuses=list(Status))  # fmt: skip


@router.get("/outstanding")
def outstanding(request: Request) -> HTMLResponse:
    session = _session(request)
    ctx = get_ctx(request)
    cursor = _param(request, "cursor")
    try:
        after = queries.OutstandingKey.decode(cursor) if cursor else None
    except queries.BadCursor:
        raise ConsoleError(400, "That page link is not valid: start from the first page.") from None
    page = queries.outstanding_confirms(ctx.engine, now=ctx.now(),
                                        flt=queries.OutstandingFilter(), limit=PAGE,
                                        after=after)  # fmt: skip
    with ctx.engine.connect() as conn:
        known = queries.publisher_rows(conn, now=ctx.now(), alive_after=ctx.alive_after)
    alive = {p.publisher_id for p in known if p.alive}
    return render(request, "outstanding.html", session=session, page=page, alive=alive)


#: Causes on one page of the failures view.
CAUSES_PAGE = 50


@router.get("/failures")
def failures(request: Request) -> HTMLResponse:
    session = _session(request)
    number = _int_param(request, "page") or 1
    found = queries.failures_page(get_ctx(request).engine, limit=CAUSES_PAGE,
                                  offset=(number - 1) * CAUSES_PAGE)  # fmt: skip
    last = max(1, -(-found.total_groups // CAUSES_PAGE))
    if number > last:
        raise ConsoleError(404, f"There is no page {number} of the failures: there are {last}.")
    return render(request, "failures.html", session=session, found=found, number=number,
                  last=last, statuses=REPUBLISH_STATUSES)  # fmt: skip


def _path_id(value: str, what: str) -> None:
    """An id from the path that no row can hold (a NUL: PostgreSQL's text refuses it)."""
    if "\x00" in value:
        raise ConsoleError(400, f"A {what} cannot hold a NUL character: check the link.")


def _status_param(request: Request) -> Status | None:
    value = _param(request, "status")
    if value is None:
        return None
    try:
        return Status(value)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise ConsoleError(400, f"Unknown status {value!r}: one of {known}.") from None


SEARCH_FIELDS = ("batch_id", "exchange", "routing_key", "ordering_key", "reason")
TIME_FIELDS = ("created_after", "created_before")


def _time_param(request: Request, name: str) -> dt.datetime | None:
    value = _param(request, name)
    if value is None:
        return None
    try:
        stamp = dt.datetime.fromisoformat(value)
    except ValueError:
        stamp = None
    if stamp is None or stamp.tzinfo is None:
        raise ConsoleError(400, f"The parameter {name!r} must be an ISO 8601 time with a zone "
                           "(2026-11-24T10:00:00Z).")  # fmt: skip
    return stamp.astimezone(dt.UTC)


def _cause_param(request: Request) -> str | None:
    """A failure group's cause, exactly as the failures view links it ("" is a cause)."""
    if "cause" not in request.query_params:
        return None
    value = request.query_params["cause"]
    if len(value) > CAUSE_LENGTH or "\x00" in value:
        raise ConsoleError(400, f"The parameter 'cause' must be at most {CAUSE_LENGTH} "
                           "characters, without a NUL.")  # fmt: skip
    return value


def _search_scope(request: Request) -> tuple[Scope, dict[str, Any]]:
    """The search's scope, and its parameters as given (for links and the form)."""
    status = _status_param(request)
    fields: dict[str, Any] = {name: _param(request, name) for name in SEARCH_FIELDS}
    times = {name: _time_param(request, name) for name in TIME_FIELDS}
    cause = _cause_param(request)
    try:
        scope = Scope(statuses=frozenset({status}) if status else frozenset(), cause=cause,
                      created_after=times["created_after"],
                      created_before=times["created_before"], **fields)  # fmt: skip
    except ScopeError as exc:
        raise ConsoleError(400, f"The search is not valid: {exc}.") from None
    shown = {k: v for k, v in fields.items() if v}
    shown |= {k: v.isoformat() for k, v in times.items() if v}
    if status:
        shown["status"] = status.value
    if cause is not None:
        shown["cause"] = cause
    return scope, shown


@router.get("/messages")
def messages(request: Request) -> HTMLResponse:
    session = _session(request)
    scope, shown = _search_scope(request)
    engine = get_ctx(request).engine
    after = _int_param(request, "after")
    page = queries.search_messages(engine, flt=scope, limit=PAGE, after=after)
    total, more_than = queries.count_scope(engine, flt=scope)
    found = page.items
    more = page.truncated or len(found) == PAGE
    nxt = {**shown, "after": found[-1].id} if more and found else None
    return render(request, "messages.html", session=session, found=found, shown=shown,
                  status=next(iter(scope.statuses), None), statuses=list(Status),
                  fields=shown, next=nxt, total=total, more_than=more_than,
                  described=scope.describe(), republish=_search_republish(scope))  # fmt: skip


def _search_republish(scope: Scope) -> dict[str, Any] | None:
    """The republish form fields of a search's terminal failures (None: it can hold none)."""
    statuses = [s.value for s in scope.statuses] or list(REPUBLISH_STATUSES)
    if not set(statuses) <= set(REPUBLISH_STATUSES):
        return None
    return {"statuses": sorted(statuses), **_as_fields(scope)}


def _as_fields(scope: Scope) -> dict[str, Any]:
    """A scope's conditions as form fields (times in ISO 8601)."""
    return {name: value.isoformat() if isinstance(value, dt.datetime) else value
            for name, value in scope.criteria().items()}  # fmt: skip


@router.get("/messages/{message_id}")
def message(request: Request, message_id: str) -> HTMLResponse:
    session = _session(request)
    ctx = get_ctx(request)
    _path_id(message_id, "message id")
    found = queries.message(ctx.engine, message_id=message_id[:MAX_FIELD], include_body=True)
    if found is None:
        raise ConsoleError(404, f"There is no message {message_id!r}.")
    own = {"batch_id": found.batch_id, "exchange": found.exchange, "message_id": found.message_id,
           "routing_key": found.routing_key, "ordering_key": found.ordering_key}  # fmt: skip
    actions = [
        e for e in queries.audit_trail(ctx.engine, limit=500)
        if all(e.filter.get(name) in (None, value) for name, value in own.items())
    ]  # fmt: skip
    events = queries.message_events(ctx.engine, outbox_id=found.id)
    return render(request, "message.html", session=session, m=found,
                  history=_history(found, events), body=_body(found.body),
                  actions=actions[:20], failed=found.status in TERMINAL_FAILURES)  # fmt: skip


#: Most characters of a body the message page shows (the REST API has it whole).
BODY_SHOWN = 4096


def _body(body: bytes | None) -> tuple[str, str]:
    """The body to show (escaped by the template) and how: its text when it is UTF-8, else
    its first bytes in hex; cut at :data:`BODY_SHOWN` characters."""
    if body is None:
        return "", "no body"
    try:
        shown, how = body.decode("utf-8"), "text"
    except UnicodeDecodeError:
        shown, how = body[: BODY_SHOWN // 2].hex(" "), "binary, in hex"
    if len(shown) > BODY_SHOWN or (how != "text" and len(body) > BODY_SHOWN // 2):
        return shown[:BODY_SHOWN], f"{how}, cut at {BODY_SHOWN} characters of {len(body)} bytes"
    return shown, how


Step = tuple[dt.datetime | None, str]


def _history(m: queries.MessageRecord, events: list[queries.MessageEvent]) -> list[Step]:
    """Every recorded fact in time order: the rare events as kept (``outbox_events``), then
    the current attempt's claim, publish and answer from the row itself."""
    kinds = {e.kind for e in events}
    steps: list[Step] = [(m.created_at, "written to the outbox")]
    steps += [(e.at, _event_words(e)) for e in events]
    if m.claimed_at:
        steps.append((m.claimed_at, f"claimed by {m.lease_owner or 'a publisher'} "
                                    f"(attempt {m.attempts} of {m.max_attempts})"))  # fmt: skip
    if m.published_at:
        where = (f" on channel {m.channel_id}, delivery tag {m.delivery_tag}"
                 if m.delivery_tag is not None else "")  # fmt: skip
        steps.append((m.published_at, f"published to {m.exchange!r}{where}"))
    steps += _current(m, kinds)
    if m.lost_confirms and "lost" not in kinds:
        steps.append((None, f"{m.lost_confirms} confirm(s) lost to a closed channel: the "
                            "broker may hold a duplicate"))  # fmt: skip
    return sorted(steps, key=lambda s: (s[0] is None, s[0] or m.created_at))


def _current(m: queries.MessageRecord, kinds: set[str]) -> list[Step]:
    """The row's own answer, unless an event already tells it (rows from before events)."""
    if m.status is Status.CONFIRMED and m.confirmed_at:
        return [(m.confirmed_at, "confirmed by the broker (ack)")]
    if m.status is Status.RETURNED and "returned" not in kinds:
        reply = f"{m.reply_code or ''} {m.reply_text or ''}".strip() or "no reply recorded"
        return [(m.confirmed_at, f"the broker returned it as unroutable ({reply}), then acked")]
    if m.status.value not in kinds and (m.status in TERMINAL_FAILURES or
                                        m.status is Status.SKIPPED):  # fmt: skip
        reason = m.last_error or m.reply_text or "no reason recorded"
        return [(None, f"now {m.status.value}: {reason}")]
    return []


def _event_words(e: queries.MessageEvent) -> str:
    """What happened, in the words of what the broker or the operator did."""
    detail = e.detail or "no reason recorded"
    by = f"{e.actor} (audit #{e.audit_id})"
    words = {
        "retry": f"attempt {e.attempt} failed: {detail}; retried after a backoff",
        "lost": f"attempt {e.attempt}: its confirm was lost ({detail}); back to pending, the "
        "broker may hold a duplicate",
        "returned": f"attempt {e.attempt}: the broker returned it as unroutable "
        f"({detail.removeprefix('returned by broker: ')}), then acked",
        "nacked": f"attempt {e.attempt} nacked by the broker ({detail}): no attempts left",
        "failed": f"attempt {e.attempt} failed for good: {detail}",
        "republished": f"republished by {by}: it was {e.from_status} ({detail}); back to "
        "pending, attempts from 0",
        "skipped": f"skipped by {by}: {detail}; it will not be delivered",
    }
    return words.get(e.kind, f"{e.kind}: {detail}")


@router.get("/audit")
def audit(request: Request) -> HTMLResponse:
    session = _session(request)
    before = _int_param(request, "before")
    entries = queries.audit_trail(get_ctx(request).engine, limit=PAGE, before=before or None)
    nxt = entries[-1].id if len(entries) == PAGE else None
    return render(request, "audit.html", session=session, entries=entries, next_before=nxt)


# ------------------------------------------------------------------------------ republish


#: The conditions a republish form may carry (``cause`` is read as sent, spaces included).
FILTER_FIELDS = tuple(name for name in CRITERIA if name != "cause")


def _republish_request(form: Mapping[str, list[str]], *, request_id: str, dry_run: bool
                       ) -> RepublishRequest:  # fmt: skip
    doc: dict[str, Any] = {"request_id": request_id, "dry_run": dry_run,
                           "limit": CHUNK}  # fmt: skip
    for name in FILTER_FIELDS:
        value = _one(form, name)
        if value is not None:
            doc[name] = value
    if "cause" in form:
        doc["cause"] = form["cause"][0]
    statuses = [s for s in form.get("statuses", []) if s]
    unknown = [s for s in statuses if s not in REPUBLISH_STATUSES]
    if unknown:
        raise ConsoleError(400, f"Only returned, nacked or failed rows are republished, "
                           f"not {unknown[0]!r}.")  # fmt: skip
    if statuses:
        doc["statuses"] = sorted(set(statuses))
    if _one(form, "all") == "yes":
        doc["all"] = True
    try:
        return RepublishRequest.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        raise ConsoleError(422, f"The republish filter is not valid: {problems}.") from None


def _problem(error: Mapping[str, Any]) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "__root__")
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _filter_fields(req: RepublishRequest) -> dict[str, Any]:
    """The filter as form fields again (for the confirmation form): every condition."""
    flt = req.to_filter()
    fields: dict[str, Any] = {"statuses": sorted(s.value for s in flt.statuses),
                              **_as_fields(flt)}  # fmt: skip
    if req.all_failures:
        fields["all"] = "yes"
    return fields


@router.get("/republish")
def republish_form(request: Request) -> HTMLResponse:
    session = _session(request)
    preset = {name: _param(request, name) or "" for name in (*FILTER_FIELDS, "status")}
    return render(request, "republish_form.html", session=session, preset=preset,
                  statuses=REPUBLISH_STATUSES)  # fmt: skip


@router.post("/republish/preview")
async def republish_preview(request: Request) -> HTMLResponse:
    session, form = await _acting(request)
    ctx = get_ctx(request)
    req = _republish_request(form, request_id=f"ui-{uuid.uuid4()}", dry_run=True)
    flt = req.to_filter()
    result = await run_in_threadpool(
        ctx.repo.republish, actor=session.principal, filter=flt, limit=req.limit, dry_run=True,
        principal=session.principal, client_addr=client_address(request),
    )  # fmt: skip
    return render(request, "republish_preview.html", session=session, result=result,
                  fields=_filter_fields(req), request_id=req.request_id,
                  described=flt.describe())  # fmt: skip


@router.post("/republish")
async def republish(request: Request) -> HTMLResponse:
    session, form = await _acting(request)
    ctx = get_ctx(request)
    request_id = _one(form, "request_id")
    if not request_id:
        raise ConsoleError(400, "The confirmation has no request id: start from the preview.")
    req = _republish_request(form, request_id=request_id, dry_run=False)
    flt = req.to_filter()
    actor = _actor(form, session)
    try:
        result = await run_in_threadpool(
            ctx.repo.republish, actor=actor, filter=flt, limit=req.limit, dry_run=False,
            request_id=req.request_id, principal=session.principal,
            client_addr=client_address(request),
        )  # fmt: skip
    except RequestIdReused as exc:
        raise ConsoleError(409, str(exc)) from None
    log.info("console: republish %s by %s (%s) moved %d of %d matching rows, audit %s, "
             "filter %r", req.request_id, actor, session.principal, result.count,
             result.matched, result.audit_id, flt.as_json())  # fmt: skip
    return render(request, "republish_done.html", session=session, result=result,
                  request_id=req.request_id, described=flt.describe(),
                  left=max(0, result.matched - result.count),
                  fields=_filter_fields(req))  # fmt: skip


# ------------------------------------------------------------------------------ parked keys


@router.get("/parked")
def parked(request: Request) -> HTMLResponse:
    session = _session(request)
    after = _param(request, "after")
    keys = queries.parked_keys(get_ctx(request).engine, limit=PAGE, after=after)
    nxt = keys[-1].ordering_key if len(keys) == PAGE else None
    return render(request, "parked.html", session=session, keys=keys, next_after=nxt)


@router.post("/skip")
async def skip(request: Request) -> HTMLResponse:
    """Skip one terminal failure (it will not be delivered; its key's parked rows go on)."""
    session, form = await _acting(request)
    message_id = _one(form, "message_id")
    reason = _one(form, "reason")
    if message_id is None or "\x00" in message_id:
        raise ConsoleError(400, "Say which message to skip.")
    if reason is None or len(reason) > MAX_REASON or has_control_characters(reason):
        raise ConsoleError(400, f"A skip needs a reason: one line of at most {MAX_REASON} "
                           "characters, without control characters.")  # fmt: skip
    actor = _actor(form, session)
    try:
        result = await run_in_threadpool(
            get_ctx(request).repo.skip, actor=actor, message_id=message_id, reason=reason,
            principal=session.principal, client_addr=client_address(request),
        )  # fmt: skip
    except CannotSkip as exc:
        raise ConsoleError(409, str(exc)) from None
    log.info("console: skip of %r by %s (%s), was %s, key %r: %d rows released, audit %s",
             message_id, actor, session.principal, result.previous.value, result.ordering_key,
             result.released, result.audit_id)  # fmt: skip
    return render(request, "skip_done.html", session=session, result=result)


# ------------------------------------------------------------------------------ the rest


@router.api_route("/{rest:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"])
def not_found(request: Request, rest: str) -> Response:
    """Any other ``/ui`` path: a console page saying so (registered last: it matches all)."""
    if rest == "":
        return RedirectResponse("/ui", 307)
    raise ConsoleError(404, "There is no such console page: start from the overview.")
