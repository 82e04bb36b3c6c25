"""The FastAPI application factory. Importing this module needs no database."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from pydantic import SecretStr
from sqlalchemy import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import console, health, keys, metrics, operators, problems, v1
from app.api.auth import _has_tokens, check_auth_config
from app.api.context import ApiContext
from app.api.limits import AuthThrottle, BodyLimit, LoopbackHostOnly
from app.api.strict import reject_unknown_query
from app.db import bounded, head_revision, make_engine
from app.logs import add_secrets
from app.outbox.actions import OperatorActions
from app.outbox.database import Clock, OutboxDatabase, utcnow
from app.settings import Settings

DESCRIPTION = """Operator surface of the outbox: what is pending, in flight (awaiting a broker
confirm), confirmed or failed, per batch and per message; safe, audited, idempotent republish.

Read endpoints take `Authorization: Bearer $OUTBOX_API_TOKEN` (or the operator token);
republish takes `Authorization: Bearer $OUTBOX_OPERATOR_TOKEN`. `/healthz` and `/readyz` are open.
"""


#: Sent on every answer over HTTPS: browsers that saw it never fall back to plain HTTP here.
HSTS = (b"strict-transport-security", b"max-age=31536000")


class StrictTransport:
    """Adds ``Strict-Transport-Security`` to every answer served over HTTPS (by uvicorn's TLS,
    or by a trusted proxy's ``X-Forwarded-Proto``); nothing over plain HTTP, where it is void."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("scheme") != "https":
            await self.app(scope, receive, send)
            return

        async def with_hsts(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), HSTS]
            await send(message)

        await self.app(scope, receive, with_hsts)


def _secrets(settings: Settings) -> list[SecretStr]:
    return [
        t
        for t in (
            settings.api_token,
            settings.operator_token,
            settings.metrics_token,
            settings.session_secret,
        )
        if t is not None
    ]


def create_app(
    settings: Settings, *, clock: Clock = utcnow, engine: Engine | None = None
) -> FastAPI:
    """Build the API for ``settings``; :class:`~app.api.auth.ApiConfigError` when it has no
    tokens (and is not explicitly insecure). ``engine`` given: the caller owns it."""
    check_auth_config(settings)
    add_secrets(*(t.get_secret_value() for t in _secrets(settings)))
    owned = engine is None
    engine = engine or make_engine(settings.database_url.get_secret_value())
    ctx = ApiContext(
        settings=settings,
        engine=bounded(engine, settings.api_statement_timeout),
        actions=OperatorActions(OutboxDatabase(engine, clock=clock)),
        clock=clock,
        head_revision=head_revision(),
        throttle=AuthThrottle(max_failures=settings.api_auth_failures_per_minute, window=60.0),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if owned:
            engine.dispose()

    app = FastAPI(
        title="outbox-sink operator API",
        version="1",
        description=DESCRIPTION,
        lifespan=lifespan,
        dependencies=[Depends(reject_unknown_query)],
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
        openapi_url="/openapi.json" if settings.api_docs else None,
    )
    app.state.ctx = ctx
    # outermost: a body over the limit is refused before any parsing or token check
    app.add_middleware(BodyLimit, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(StrictTransport)
    if settings.api_insecure and not _has_tokens(settings):
        app.add_middleware(LoopbackHostOnly)  # no tokens: no answer to a rebound DNS name
    app.include_router(health.router)
    app.include_router(v1.router)
    app.include_router(keys.router)
    app.include_router(operators.router)
    app.include_router(metrics.router)
    console.install(app)
    problems.install(app)
    return app
