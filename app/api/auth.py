"""Bearer-token auth: a read token and an operator token (which also grants read).

Tokens come from :class:`~app.settings.Settings`, are compared in constant time, and never
appear in a response or a log line.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from app.api.context import ApiContext, client_address, get_ctx
from app.api.limits import StrictJsonRoute
from app.api.models import Actor
from app.outbox.actions import Acting
from app.settings import Settings
from app.tokens import token_weakness

bearer = HTTPBearer(
    auto_error=False,
    description="OUTBOX_API_TOKEN for reading; OUTBOX_OPERATOR_TOKEN for reading and writing.",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
CHALLENGE = {"WWW-Authenticate": "Bearer"}
log = logging.getLogger("app.api.auth")


class ApiConfigError(ValueError):
    """Settings the API refuses to start with (blame: the operator's configuration)."""


class Role(IntEnum):
    METRICS = 0
    READER = 1
    OPERATOR = 2


def check_auth_config(settings: Settings) -> None:
    """Refuse to serve without tokens (unless explicitly insecure) or with one token for both."""
    read, op, metrics = settings.api_token, settings.operator_token, settings.metrics_token
    if read is None and op is None and metrics is None and not settings.api_insecure:
        raise ApiConfigError(
            "no API token configured: set OUTBOX_API_TOKEN (read) and OUTBOX_OPERATOR_TOKEN "
            "(operator), or run `outbox serve --insecure` (OUTBOX_API_INSECURE=true) "
            "for local use only"
        )
    if read is not None and op is not None and _same(read, op):
        raise ApiConfigError(
            "OUTBOX_API_TOKEN and OUTBOX_OPERATOR_TOKEN must differ: the read token "
            "would grant operator actions"
        )
    if metrics is not None and any(t is not None and _same(metrics, t) for t in (read, op)):
        raise ApiConfigError(
            "OUTBOX_METRICS_TOKEN must differ from the other tokens: it would grant what they do"
        )
    named = (
        ("OUTBOX_API_TOKEN", read),
        ("OUTBOX_OPERATOR_TOKEN", op),
        ("OUTBOX_METRICS_TOKEN", metrics),
    )
    for name, token in named:
        if token is None:
            continue
        weakness = token_weakness(token.get_secret_value())
        if weakness is not None:
            raise ApiConfigError(f"{name} {weakness}: generate one with `outbox token`")


def _same(a: SecretStr, b: SecretStr) -> bool:
    return secrets.compare_digest(a.get_secret_value().encode(), b.get_secret_value().encode())


def _matches(given: bytes, expected: SecretStr | None) -> bool:
    if expected is None:
        return False
    return secrets.compare_digest(given, expected.get_secret_value().encode())


def role_of(
    settings: Settings,
    credentials: HTTPAuthorizationCredentials | None,
    *,
    ctx: ApiContext | None = None,
    client: str = "unknown",
) -> Role:
    """The role a request's bearer token grants; 401 when missing or unknown, 429 for every
    request of a client over its budget of failures (counted in ``ctx.throttle``).

    Over the budget the right token gets 429 too: answering it would tell a guesser which guess
    was right, and the budget would bound nothing. The price is that wrong tokens sent from an
    operator's address (a shared NAT) hold the operator's bearer requests and new console
    sign-ins off for up to the window (60 s); a console session already signed in is not
    throttled. Only failures are counted, and a token is long enough (check_auth_config) that the
    budget is not what keeps it secret.
    """
    if not _has_tokens(settings):
        return Role.OPERATOR  # check_auth_config let this through: explicit insecure mode
    if ctx is not None:
        try:
            ctx.throttle.check(client)  # over its budget: 429 whatever the token, not counted
        except HTTPException:
            log.warning("authentication refused from %s: over its budget of failures", client)
            raise
    try:
        return _role(settings, credentials)
    except HTTPException:
        if ctx is not None:
            ctx.throttle.failed(client)
        log.warning("failed authentication from %s", client)
        raise


def _role(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> Role:
    if credentials is None:
        raise HTTPException(
            401, "missing bearer token: send 'Authorization: Bearer <token>'", CHALLENGE
        )
    given = credentials.credentials.encode("utf-8", "surrogateescape")
    is_op = _matches(given, settings.operator_token)
    is_reader = _matches(given, settings.api_token)  # all compared: timing shows no order
    is_metrics = _matches(given, settings.metrics_token)
    if is_op:
        return Role.OPERATOR
    if is_reader:
        return Role.READER
    if is_metrics:
        return Role.METRICS
    raise HTTPException(401, "invalid bearer token", CHALLENGE)


def require_reader(
    credentials: Credentials, ctx: Annotated[ApiContext, Depends(get_ctx)], request: Request
) -> Role:
    role = role_of(ctx.settings, credentials, ctx=ctx, client=client_address(request))
    if role < Role.READER:
        raise HTTPException(403, METRICS_ONLY)
    return role


#: What a request with the metrics token is told anywhere but /metrics.
METRICS_ONLY = "this token reads /metrics only (OUTBOX_METRICS_TOKEN): use OUTBOX_API_TOKEN"


def require_metrics(
    credentials: Credentials, ctx: Annotated[ApiContext, Depends(get_ctx)], request: Request
) -> Role:
    """Any token: the metrics token, the read token or the operator token."""
    return role_of(ctx.settings, credentials, ctx=ctx, client=client_address(request))


@dataclass(frozen=True, slots=True)
class Caller:
    """Who acts, for the audit row: ``principal`` is what the server verified (which token),
    ``client`` the peer address; ``actor`` is what the client claims (``X-Outbox-Actor``)."""

    actor: str
    principal: str
    client: str

    def acting(self) -> Acting:
        """The audit row's who, as :class:`~app.outbox.actions.OperatorActions` takes it."""
        return Acting(actor=self.actor, principal=self.principal, client_addr=self.client)


def require_operator(
    credentials: Credentials,
    ctx: Annotated[ApiContext, Depends(get_ctx)],
    request: Request,
    actor: Annotated[
        Actor | None,
        Header(
            alias="X-Outbox-Actor",
            description="Who acts, as the client claims it (kept in the audit row beside the "
            "token that authenticated and the client address); default: the token's name.",
        ),
    ] = None,
) -> Caller:
    """Operator role required; returns who acts for the audit row."""
    client = client_address(request)
    role = role_of(ctx.settings, credentials, ctx=ctx, client=client)
    if role < Role.OPERATOR:
        raise HTTPException(403, "this action needs the operator token (OUTBOX_OPERATOR_TOKEN)")
    principal = "operator-token" if _has_tokens(ctx.settings) else "anonymous (insecure mode)"
    return Caller(actor=actor or principal, principal=principal, client=client)


def _has_tokens(settings: Settings) -> bool:
    return any(
        t is not None for t in (settings.api_token, settings.operator_token, settings.metrics_token)
    )


class TokenJsonRoute(StrictJsonRoute):
    """A strict JSON route whose body is parsed only once the bearer token is good (a 60 KB body
    of nested ``[`` without a token is a 401 counted in the throttle, not parsed)."""

    def before_body(self, request: Request) -> None:
        ctx = get_ctx(request)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else ""
        creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=given) if given else None
        role_of(ctx.settings, creds, ctx=ctx, client=client_address(request))
