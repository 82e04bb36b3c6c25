"""The web console, ``/ui``: server-rendered pages (Jinja2, no JavaScript) over the same queries
and the same audited republish as the REST API.

Sign-in takes a token once and sets a session cookie (:mod:`app.api.console.session`); the read
token sees every page, the operator token also republishes. A republish is always a dry run
first (count and sample), then an explicit confirmation that carries a request id chosen at
preview time: pressing it twice replays the first result instead of moving rows again.

The pages live in modules by page (sign-in, overview, batches, failures, messages, writer
rejects, audit, actions), on the shared machinery of :mod:`app.api.console.base`; this package
puts them under ``/ui`` in order, and last the catch-all that answers any other path with a
console 404.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import RedirectResponse

from app.api.console import (
    actions,
    audit,
    batches,
    failures,
    messages,
    overview,
    rejects,
    signin,
    store,
)
from app.api.console.base import (
    ConsoleError,
    ConsoleRoute,
    LoginRequired,
    console_error,
    safe_next,
    to_login,
)

__all__ = ["install", "router", "safe_next"]

router = APIRouter(include_in_schema=False, route_class=ConsoleRoute)
for page in (signin, overview, batches, failures, messages, rejects, audit, actions):
    router.include_router(page.router, prefix="/ui")


def install(app: FastAPI) -> None:
    ctx = app.state.ctx
    app.state.console_sessions = store.ConsoleSessions(ctx.settings, ctx.engine)
    app.include_router(router)
    app.add_exception_handler(LoginRequired, to_login)
    app.add_exception_handler(ConsoleError, console_error)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui", 307)


# registered after every page: it matches any path
@router.api_route("/ui/{rest:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"])
def not_found(request: Request, rest: str) -> Response:
    """Any other ``/ui`` path: a console page saying so."""
    if rest == "":
        return RedirectResponse("/ui", 307)
    raise ConsoleError(404, "There is no such console page: start from the overview.")
