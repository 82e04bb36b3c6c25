"""Errors as RFC 9457 problem details (``application/problem+json``), for every route.

Every error the API answers, whatever raised it (a route's ``HTTPException``, a validation
failure, an unknown path or method, the database being down, a bug), has the same shape:
``type``, ``title``, ``status``, ``detail`` and ``instance`` (the request path), plus ``errors``
(each invalid field: ``loc``, ``msg``, ``type``) when the request failed validation. The OpenAPI
document says so for every 4xx and 5xx answer (:func:`problem_openapi`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.db import stopped_by_bound

PROBLEM_JSON = "application/problem+json"
log = logging.getLogger("app.api")


class ProblemResponse(JSONResponse):
    media_type = PROBLEM_JSON


def title_of(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def problem(
    status: int,
    detail: str,
    *,
    request: Request | None = None,
    title: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extensions: Any,
) -> ProblemResponse:
    body: dict[str, Any] = {
        "type": "about:blank",
        "title": title or title_of(status),
        "status": status,
        "detail": detail,
    }
    if request is not None:
        body["instance"] = request.url.path
    body.update(extensions)
    return ProblemResponse(jsonable_encoder(body), status, headers=dict(headers or {}))


def _where(loc: Sequence[Any]) -> str:
    return ".".join(str(part) for part in loc) or "request"


def summarize(errors: Sequence[Mapping[str, Any]], *, shown: int = 3) -> str:
    """One line naming the invalid fields: ``query.limit: Input should be ... (and 2 more)``."""
    parts = [f"{_where(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:shown]]
    more = len(errors) - shown
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "") or "invalid request"


async def _http_error(request: Request, exc: Exception) -> ProblemResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else summarize(exc.detail or [])
    return problem(exc.status_code, detail, request=request, headers=exc.headers)


def _field_error(e: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "loc": list(e.get("loc", ())),
        "msg": str(e.get("msg", "")),
        "type": str(e.get("type", "")),
    }


async def _invalid(request: Request, exc: Exception) -> ProblemResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [_field_error(e) for e in exc.errors()]
    return problem(
        422, summarize(errors), request=request, title="Request validation failed", errors=errors
    )


async def _database_unavailable(request: Request, exc: Exception) -> ProblemResponse:
    """Connection refused, lock timeout, server gone: the database's fault, not a bug. A
    statement stopped at the API's time bound says so, and how to narrow the request."""
    if isinstance(exc, DBAPIError) and stopped_by_bound(exc):
        bound = request.app.state.ctx.settings.api_statement_timeout
        log.warning("api: %s stopped at its time bound (%g s)", request.url.path, bound)
        return problem(503, too_slow(bound), request=request)
    log.warning("api: database unavailable on %s: %s", request.url.path, type(exc).__name__)
    return problem(503, f"database unavailable: {type(exc).__name__}", request=request)


def too_slow(bound: float) -> str:
    """What a reader is told when its request ran into the API's time bound."""
    return (
        f"the query ran longer than {bound:g} s (OUTBOX_API_STATEMENT_TIMEOUT) and was "
        "stopped: narrow it (a status, a batch, an exchange, a time range) and retry"
    )


async def _schema_missing(request: Request, _exc: Exception) -> ProblemResponse:
    return problem(
        503, "database schema missing or outdated: run `outbox migrate`", request=request
    )


async def _bug(request: Request, exc: Exception) -> ProblemResponse:
    log.error("api: unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem(500, "internal error (logged by the server)", request=request)


def install(app: FastAPI) -> None:
    """Every error of ``app`` as a problem document, and the OpenAPI document saying so."""
    handlers: list[tuple[type[Exception] | int, Callable[..., Any]]] = [
        (StarletteHTTPException, _http_error),
        (RequestValidationError, _invalid),
        (OperationalError, _database_unavailable),
        (InterfaceError, _database_unavailable),
        (ProgrammingError, _schema_missing),
        (Exception, _bug),
    ]
    for exc_class, handler in handlers:
        app.add_exception_handler(exc_class, handler)
    app.openapi = lambda: problem_openapi(app)  # type: ignore[method-assign]


PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "Problem",
    "description": "RFC 9457 problem details.",
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "description": "about:blank: the status says it all."},
        "title": {"type": "string", "description": "The HTTP status phrase."},
        "status": {"type": "integer"},
        "detail": {"type": "string", "description": "What is wrong, for a person."},
        "instance": {"type": "string", "description": "The request path."},
        "errors": {
            "type": "array",
            "description": "Validation failures (422 only): where and what.",
            "items": {
                "type": "object",
                "required": ["loc", "msg", "type"],
                "properties": {
                    "loc": {
                        "type": "array",
                        "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                    },
                    "msg": {"type": "string"},
                    "type": {"type": "string"},
                },
            },
        },
    },
}


GENERIC_ERRORS = ("ErrorBody", "HTTPValidationError")


def _generic(answer: Mapping[str, Any]) -> bool:
    """An error answer with no body of its own (``/readyz``'s 503 has one: kept)."""
    schemas = [c.get("schema", {}) for c in answer.get("content", {}).values()]
    refs = [str(s.get("$ref", "")).rsplit("/", 1)[-1] for s in schemas]
    return all(ref in GENERIC_ERRORS for ref in refs)


def problem_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with every 4xx/5xx answer as ``application/problem+json`` (cached)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = PROBLEM_SCHEMA
    ref = {"$ref": "#/components/schemas/Problem"}
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            for code, answer in operation.get("responses", {}).items():
                if str(code)[0] in "45" and _generic(answer):
                    answer["content"] = {PROBLEM_JSON: {"schema": ref}}
                    if str(code) == "422":
                        answer["description"] = "The request failed validation (see errors)."
    for unused in ("HTTPValidationError", "ValidationError", "ErrorBody"):
        components.pop(unused, None)
    app.openapi_schema = doc
    return doc
