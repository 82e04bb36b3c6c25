"""What every console page shares: the route class, templates, sessions, forms and
parameters, error pages and the security headers."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy.exc import InterfaceError, OperationalError, ProgrammingError
from starlette.concurrency import run_in_threadpool

from app import rates as charts
from app.api.console import store
from app.api.console.session import COOKIE, Session, SessionError, SessionSigner
from app.api.context import client_address, get_ctx
from app.api.problems import too_slow
from app.db import stopped_by_bound
from app.outbox.actions import MAX_ACTOR, Acting, has_control_characters
from app.outbox.read.cursors import BadCursor
from app.outbox.scope import CAUSE_LENGTH, Scope, ScopeError
from app.outbox.states import Status

log = logging.getLogger("app.api.console")

#: A page link decoded (:func:`cursor_param`).
C = TypeVar("C")


HERE = Path(__file__).resolve().parent


MAX_FIELD = 1000


NONE = "\N{EN DASH}"


STALE_FORM = (
    "This form was not sent from this console session (its CSRF token is missing or "
    "stale). Reload the page and try again."
)


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
                if stopped_by_bound(exc):
                    bound = get_ctx(request).settings.api_statement_timeout
                    log.warning("console: %s stopped at its time bound", request.url.path)
                    said = too_slow(bound)
                    return error_page(request, 503, said[0].upper() + said[1:] + ".")
                log.warning("console: database unavailable: %s", type(exc).__name__)
                message = f"The database is unavailable ({type(exc).__name__}); try again."
                return error_page(request, 503, message)
            except ProgrammingError:
                return error_page(
                    request,
                    503,
                    "The database schema is missing or outdated: run `outbox migrate`.",
                )

        return guarded


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


env.filters.update(
    age=_age,
    when=_when,
    ago=_ago,
    query=lambda d: urlencode(d, doseq=True),
    rate=charts.rate_words,
)


def sessions_of(request: Request) -> store.ConsoleSessions:
    sessions: store.ConsoleSessions = request.app.state.console_sessions
    return sessions


def signer_of(request: Request) -> SessionSigner:
    """The session signer (its secret read from the database on first use: call from a
    worker thread)."""
    return sessions_of(request).signer(now=get_ctx(request).now())


def now_ts(request: Request) -> float:
    return get_ctx(request).now().timestamp()


def session_of(request: Request) -> Session:
    """The request's live session (its cookie checked, then its row: blocking I/O, call from a
    worker thread); :class:`LoginRequired` otherwise."""
    try:
        session = signer_of(request).read(request.cookies.get(COOKIE), now=now_ts(request))
        if not store.session_live(
            sessions_of(request).engine, session_id=session.nonce, now=get_ctx(request).now()
        ):
            raise SessionError("the session ended (signed out on the server): sign in again")
        return session
    except SessionError as exc:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target, str(exc), expired=exc.expired) from None


def render(
    request: Request,
    template: str,
    *,
    session: Session | None,
    code: int = 200,
    **values: Any,
) -> HTMLResponse:
    csrf = signer_of(request).csrf(session) if session else ""
    values.setdefault("now", get_ctx(request).now())
    html = env.get_template(template).render(
        session=session, csrf=csrf, path=request.url.path, **values
    )
    return HTMLResponse(html, code, headers=SECURITY_HEADERS)


def error_page(request: Request, status: int, message: str) -> HTMLResponse:
    """An error page, with the navigation of the cookie's session if it has one (read without
    the database, which may be why the page is shown: any action checks the session in full)."""
    signer = sessions_of(request).loaded()
    try:
        cookie = request.cookies.get(COOKIE)
        session = signer.read(cookie, now=now_ts(request)) if signer and cookie else None
    except SessionError:
        session = None
    return render(request, "error.html", session=session, code=status, message=message)


async def console_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ConsoleError)
    return error_page(request, exc.status, exc.message)


async def to_login(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LoginRequired)
    query = {"next": exc.target, **({"expired": "1"} if exc.expired else {})}
    return RedirectResponse(f"/ui/login?{urlencode(query)}", 303, headers=SECURITY_HEADERS)


def safe_next(target: str | None) -> str:
    """Only a console path: never an open redirect to another site."""
    if target and target.startswith("/ui") and not target.startswith("//"):
        return target
    return "/ui"


async def read_form(request: Request) -> dict[str, list[str]]:
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


def one(form: Mapping[str, list[str]], name: str) -> str | None:
    values = form.get(name) or [""]
    value = values[0].strip()
    if len(value) > MAX_FIELD:
        raise ConsoleError(400, f"The field {name!r} is longer than {MAX_FIELD} characters.")
    return value or None


def actor_of(form: Mapping[str, list[str]], session: Session) -> str:
    """Who acted, for the audit row: the name typed in, else the signed-in token's name. A
    name is one line (a NUL would fail the audit row's write on PostgreSQL; other control
    characters would forge lines in the log)."""
    value = one(form, "actor")
    if value is None:
        return session.principal
    if len(value) > MAX_ACTOR or has_control_characters(value):
        raise ConsoleError(
            400,
            f"Your name for the audit row must be one line of at most "
            f"{MAX_ACTOR} characters, without control characters.",
        )
    return value


def who_acts(form: Mapping[str, list[str]], session: Session, request: Request) -> Acting:
    """The audit row's who: :func:`actor_of`, the signed-in token's name, the peer address."""
    return Acting(
        actor=actor_of(form, session),
        principal=session.principal,
        client_addr=client_address(request),
    )


def param(request: Request, name: str) -> str | None:
    value = (request.query_params.get(name) or "").strip()
    if len(value) > MAX_FIELD:
        raise ConsoleError(400, f"The parameter {name!r} is longer than {MAX_FIELD} characters.")
    if "\x00" in value:
        raise ConsoleError(400, f"The parameter {name!r} holds a NUL character.")
    return value or None


def cursor_param(request: Request, decode: Callable[[str], C]) -> C | None:
    """``?cursor=``: a page link this console made, decoded by ``decode`` (None: the first
    page); anything else is a 400 that sends the operator back to the first page."""
    cursor = param(request, "cursor")
    try:
        return decode(cursor) if cursor else None
    except BadCursor:
        raise ConsoleError(400, "That page link is not valid: start from the first page.") from None


def int_param(request: Request, name: str) -> int | None:
    value = param(request, name)
    if value is None:
        return None
    if not value.isdigit() or len(value) > 18:
        raise ConsoleError(400, f"The parameter {name!r} must be a whole number.")
    return int(value)


async def acting(request: Request) -> tuple[Session, dict[str, list[str]]]:
    """A state-changing form: a session, its CSRF token, and the operator role."""
    session = await run_in_threadpool(session_of, request)
    form = await read_form(request)
    if not signer_of(request).csrf_ok(session, one(form, "csrf")):
        log.warning("console: form without a valid CSRF token from %s", client_address(request))
        raise ConsoleError(403, STALE_FORM)
    if not session.can_act:
        raise ConsoleError(
            403,
            "Republish needs the operator token: you signed in with the "
            "read token, which can look but not act.",
        )
    return session, form


def check_path_id(value: str, what: str) -> None:
    """An id from the path that no row can hold (a NUL: PostgreSQL's text refuses it)."""
    if "\x00" in value:
        raise ConsoleError(400, f"A {what} cannot hold a NUL character: check the link.")


def status_param(request: Request) -> Status | None:
    value = param(request, "status")
    if value is None:
        return None
    try:
        return Status(value)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise ConsoleError(400, f"Unknown status {value!r}: one of {known}.") from None


SEARCH_FIELDS = ("batch_id", "exchange", "routing_key", "stream", "ordering_key", "reason")
#: Conditions whose empty value is a real one: the default exchange, an empty routing key. A
#: field left empty in a form means "any", so these travel as ``empty=<name>`` instead.
EMPTY_FIELDS = ("exchange", "routing_key")


def empty_conditions(names: list[str], given: Mapping[str, Any]) -> dict[str, str]:
    """The conditions ``empty=<name>`` asks for (``{name: ""}``), checked against ``given``."""
    out: dict[str, str] = {}
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name not in EMPTY_FIELDS:
            allowed = " or ".join(EMPTY_FIELDS)
            raise ConsoleError(
                400, f"Only the {allowed} may be asked for empty, not {name[:40]!r}."
            )
        if given.get(name):
            raise ConsoleError(400, f"The {name} is asked for both empty and as {given[name]!r}.")
        out[name] = ""
    return out


def scope_fields(conditions: Mapping[str, Any]) -> dict[str, Any]:
    """Conditions as form or query fields: an empty exchange or routing key as ``empty``."""
    empty = sorted(n for n in EMPTY_FIELDS if conditions.get(n) == "")
    fields = {n: v for n, v in conditions.items() if n not in empty}
    return fields | {"empty": empty} if empty else fields


def place_fields(
    exchange: str, stream: str | None, routing_key: str | None = None
) -> dict[str, Any]:
    """Where a failures group's rows go, as fields: its stream, or its exchange (and key)."""
    if stream is not None:
        return {"stream": stream}
    place = {"exchange": exchange}
    if routing_key is not None:
        place["routing_key"] = routing_key
    return scope_fields(place)


env.globals["place_fields"] = place_fields


TIME_FIELDS = ("created_after", "created_before")


def time_param(request: Request, name: str) -> dt.datetime | None:
    value = param(request, name)
    if value is None:
        return None
    try:
        stamp = dt.datetime.fromisoformat(value)
    except ValueError:
        stamp = None
    if stamp is None or stamp.tzinfo is None:
        raise ConsoleError(
            400,
            f"The parameter {name!r} must be an ISO 8601 time with a zone (2026-11-24T10:00:00Z).",
        )
    return stamp.astimezone(dt.UTC)


def cause_param(request: Request) -> str | None:
    """A failure group's cause, exactly as the failures view links it ("" is a cause)."""
    if "cause" not in request.query_params:
        return None
    value = request.query_params["cause"]
    if len(value) > CAUSE_LENGTH or "\x00" in value:
        raise ConsoleError(
            400, f"The parameter 'cause' must be at most {CAUSE_LENGTH} characters, without a NUL."
        )
    return value


def search_scope(request: Request) -> tuple[Scope, dict[str, Any]]:
    """The search's scope, and its parameters as given (for links and the form)."""
    status = status_param(request)
    fields: dict[str, Any] = {name: param(request, name) for name in SEARCH_FIELDS}
    asked = [n for n in request.query_params.getlist("empty") if not fields.get(n.strip())]
    empty = empty_conditions(asked, fields)  # a value typed into the form wins
    fields |= empty
    times = {name: time_param(request, name) for name in TIME_FIELDS}
    cause = cause_param(request)
    try:
        scope = Scope(
            statuses=frozenset({status}) if status else frozenset(),
            cause=cause,
            created_after=times["created_after"],
            created_before=times["created_before"],
            **fields,
        )
    except ScopeError as exc:
        raise ConsoleError(400, f"The search is not valid: {exc}.") from None
    shown: dict[str, Any] = {k: v for k, v in fields.items() if v}
    if empty:
        shown["empty"] = sorted(empty)
    shown |= {k: v.isoformat() for k, v in times.items() if v}
    if status:
        shown["status"] = status.value
    if cause is not None:
        shown["cause"] = cause
    return scope, shown


Step = tuple[dt.datetime | None, str]


def page_router() -> APIRouter:
    """The router of one page module; the package includes them all under ``/ui``."""
    return APIRouter(route_class=ConsoleRoute, include_in_schema=False)
