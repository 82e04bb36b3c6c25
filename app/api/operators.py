"""``/v1/failures`` (terminal failures grouped by cause), ``/v1/audit`` (operator actions),
``/v1/rejects`` (rows the Spark writer refused) and
``/v1/messages`` (messages by status, batch, exchange, routing key, stream, ordering key,
reason)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import Query
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field

from app.api.context import ApiContext
from app.api.models import (
    FailuresOut,
    MessageOut,
    Place,
    StreamName,
    Text,
    UtcDatetime,
    copied,
)
from app.api.v1 import Ctx, reader_router
from app.outbox.read.audit import audit_trail
from app.outbox.read.failures import failures_by_cause
from app.outbox.read.messages import search_messages
from app.outbox.read.rejects import writer_rejects
from app.outbox.scope import Scope, ScopeError
from app.outbox.states import Status

router = reader_router()


class AuditOut(BaseModel):
    id: int
    at: dt.datetime
    actor: str = Field(description="Who the client said acts (X-Outbox-Actor, --actor).")
    principal: str | None = Field(description="Who the server verified (the token's name).")
    client_addr: str | None
    action: str
    request_id: str | None
    filter: dict[str, Any]
    count: int


class AuditPage(BaseModel):
    items: list[AuditOut]
    next_before: int | None = Field(description="Pass as `before` for the next (older) page.")


@router.get("/failures", response_model=FailuresOut, summary="Terminal failures by cause")
def get_failures(ctx: Ctx, limit: Annotated[int, Query(ge=1, le=500)] = 50) -> FailuresOut:
    return FailuresOut.of(failures_by_cause(ctx.engine, limit=limit))


@router.get("/audit", response_model=AuditPage, summary="Operator actions, newest first")
def get_audit(
    ctx: Ctx,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
) -> AuditPage:
    entries = audit_trail(ctx.engine, limit=limit, before=before)
    items = [copied(AuditOut, e) for e in entries]
    nxt = entries[-1].id if len(entries) == limit else None
    return AuditPage(items=items, next_before=nxt)


class RejectOut(BaseModel):
    id: int
    batch_id: str
    sink: str
    message_id: str | None
    reason: str = Field(
        description="Why the Spark writer refused the row (a bad value, or a "
        "message id held by another message)."
    )
    row_json: str = Field(description="The row as the writer saw it, as JSON text.")
    created_at: dt.datetime


class RejectPage(BaseModel):
    items: list[RejectOut]
    next_before: int | None = Field(description="Pass as `before` for the next (older) page.")


@router.get(
    "/rejects",
    response_model=RejectPage,
    summary="Rows the Spark writer refused (reject mode), newest first",
)
def get_rejects(
    ctx: Ctx,
    batch_id: Annotated[Text | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
) -> RejectPage:
    found = writer_rejects(ctx.engine, batch_id=batch_id, limit=limit, before=before)
    nxt = found[-1].id if len(found) == limit else None
    return RejectPage(items=[copied(RejectOut, r) for r in found], next_before=nxt)


class MessagePage(BaseModel):
    items: list[MessageOut]
    next_after: int | None = Field(description="Pass as `after` for the next page.")
    truncated: bool = Field(
        default=False,
        description="The page stopped before `limit` rows at the byte budget "
        "(about 4 MiB of headers, properties and reasons): the rest follows `next_after`.",
    )


def _search(ctx: ApiContext, *, flt: Scope, limit: int, after: int | None) -> MessagePage:
    found = search_messages(ctx.engine, flt=flt, limit=limit, after=after)
    more = found.truncated or len(found.items) == limit
    nxt = found.items[-1].id if more and found.items else None
    return MessagePage(
        items=[MessageOut.of(m) for m in found.items], next_after=nxt, truncated=found.truncated
    )


def _bad_range(exc: ScopeError) -> RequestValidationError:
    """The scope's own rules (a range in order), as a 422 on ``created_after``."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("query", "created_after"), "input": None, "msg": str(exc)}]
    )


Statuses = Annotated[list[Status] | None, Query(alias="status", description="Repeatable.")]
Reason = Annotated[
    Text | None, Query(description="Substring of the error or reply text, any case.")
]
CreatedAfter = Annotated[UtcDatetime | None, Query(description="Inclusive, ISO 8601 with a zone.")]
CreatedBefore = Annotated[UtcDatetime | None, Query(description="Exclusive, ISO 8601 with a zone.")]
Limit = Annotated[int, Query(ge=1, le=500)]
After = Annotated[
    int | None, Query(ge=0, le=2**63 - 1, description="next_after of the previous page.")
]


@router.get(
    "/messages",
    response_model=MessagePage,
    summary="Messages by status, batch, exchange, routing key, stream, ordering key, reason, "
    "created range",
)
def list_messages(
    ctx: Ctx,
    status: Statuses = None,
    batch_id: Annotated[Text | None, Query()] = None,
    exchange: Annotated[Place | None, Query(description='"" is the default exchange.')] = None,
    routing_key: Annotated[Place | None, Query()] = None,
    stream: Annotated[StreamName | None, Query()] = None,
    ordering_key: Annotated[Text | None, Query()] = None,
    reason: Reason = None,
    created_after: CreatedAfter = None,
    created_before: CreatedBefore = None,
    limit: Limit = 50,
    after: After = None,
) -> MessagePage:
    """Keyset pages in id order, without bodies (``GET /v1/messages/{id}`` has the body)."""
    try:
        flt = Scope(
            statuses=frozenset(status or ()),
            batch_id=batch_id,
            exchange=exchange,
            routing_key=routing_key,
            stream=stream,
            ordering_key=ordering_key,
            reason=reason,
            created_after=created_after,
            created_before=created_before,
        )
    except ScopeError as exc:
        raise _bad_range(exc) from None
    return _search(ctx, flt=flt, limit=limit, after=after)
