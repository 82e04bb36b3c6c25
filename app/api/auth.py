"""Bearer-token auth: a read token and an operator token (which also grants read).

Tokens come from :class:`~app.settings.Settings`, are compared in constant time, and never
appear in a response or a log line.
"""

from __future__ import annotations

import secrets
from enum import IntEnum
from typing import Annotated

from fastapi import Depends, Header, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from app.api.context import ApiContext, get_ctx
from app.api.models import Actor
from app.settings import Settings

bearer = HTTPBearer(
    auto_error=False,
    description="OUTBOX_API_TOKEN for reading; OUTBOX_OPERATOR_TOKEN for reading and writing.",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
CHALLENGE = {"WWW-Authenticate": "Bearer"}


class ApiConfigError(ValueError):
    """Settings the API refuses to start with (blame: the operator's configuration)."""


class Role(IntEnum):
    READER = 1
    OPERATOR = 2


def check_auth_config(settings: Settings) -> None:
    """Refuse to serve without tokens (unless explicitly insecure) or with one token for both."""
    read, op = settings.api_token, settings.operator_token
    if read is None and op is None and not settings.api_insecure:
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
    for name, token in (("OUTBOX_API_TOKEN", read), ("OUTBOX_OPERATOR_TOKEN", op)):
        if token is not None and not token.get_secret_value().strip():
            raise ApiConfigError(f"{name} is empty")


def _same(a: SecretStr, b: SecretStr) -> bool:
    return secrets.compare_digest(a.get_secret_value().encode(), b.get_secret_value().encode())


def _matches(given: bytes, expected: SecretStr | None) -> bool:
    if expected is None:
        return False
    return secrets.compare_digest(given, expected.get_secret_value().encode())


def role_of(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> Role:
    """The role a request's bearer token grants; 401 when missing or unknown."""
    if not _has_tokens(settings):
        return Role.OPERATOR  # check_auth_config let this through: explicit insecure mode
    if credentials is None:
        raise HTTPException(
            401, "missing bearer token: send 'Authorization: Bearer <token>'", CHALLENGE
        )
    given = credentials.credentials.encode("utf-8", "surrogateescape")
    is_op = _matches(given, settings.operator_token)
    is_reader = _matches(given, settings.api_token)  # both compared: timing shows no order
    if is_op:
        return Role.OPERATOR
    if is_reader:
        return Role.READER
    raise HTTPException(401, "invalid bearer token", CHALLENGE)


def require_reader(credentials: Credentials, ctx: Annotated[ApiContext, Depends(get_ctx)]) -> Role:
    return role_of(ctx.settings, credentials)


def require_operator(
    credentials: Credentials,
    ctx: Annotated[ApiContext, Depends(get_ctx)],
    actor: Annotated[
        Actor | None,
        Header(
            alias="X-Outbox-Actor",
            description="Who acts (written to the audit row); default 'operator-token'.",
        ),
    ] = None,
) -> str:
    """Operator role required; returns the actor name for the audit row."""
    role = role_of(ctx.settings, credentials)
    if role < Role.OPERATOR:
        raise HTTPException(403, "this action needs the operator token (OUTBOX_OPERATOR_TOKEN)")
    if actor is not None:
        return actor
    return "operator-token" if _has_tokens(ctx.settings) else "anonymous (insecure mode)"


def _has_tokens(settings: Settings) -> bool:
    return settings.api_token is not None or settings.operator_token is not None
