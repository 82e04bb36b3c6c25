"""``/v1``: stats, outstanding confirms, batches, messages, republish."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Depends, HTTPException, Path, Query
from fastapi.exceptions import RequestValidationError

from app.api.auth import Caller, TokenJsonRoute, require_operator, require_reader
from app.api.context import ApiContext, get_ctx
from app.api.models import (
    MAX_AGE_SECONDS,
    BatchOut,
    BatchPage,
    BatchRepublishRequest,
    Cursor,
    ErrorBody,
    MessageOut,
    OutstandingOut,
    OutstandingPage,
    Place,
    RepublishOut,
    RepublishRequest,
    StatsOut,
    StreamLaneOut,
    StreamName,
    Text,
)
from app.outbox.actions import RequestIdReused
from app.outbox.read.batches import BatchCursor, batch_exists, batch_summary, list_batches
from app.outbox.read.cursors import BadCursor
from app.outbox.read.messages import message
from app.outbox.read.outstanding import (
    OutstandingFilter,
    OutstandingKey,
    list_lanes,
    outstanding_confirms,
)
from app.outbox.read.stats import stats_for
from app.outbox.scope import RepublishFilter
from app.outbox.shown import MAX_SHOWN_BODY
from app.outbox.states import Status

Ctx = Annotated[ApiContext, Depends(get_ctx)]
Operator = Annotated[Caller, Depends(require_operator)]
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or unknown bearer token."},
    413: {"description": "The request body is over OUTBOX_API_MAX_BODY_BYTES (problem+json)."},
    429: {
        "model": ErrorBody,
        "description": "Too many failed authentications from this client (see Retry-After).",
    },
    503: {"model": ErrorBody, "description": "The database is unreachable."},
}
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    400: {
        "model": ErrorBody,
        "description": "The body is not strict JSON (not UTF-8, a "
        "duplicate key, NaN/Infinity, a number out of range, a lone surrogate).",
    },
    415: {"model": ErrorBody, "description": "The body is not application/json."},
    403: {"model": ErrorBody, "description": "A read token on an operator action."},
    409: {
        "model": ErrorBody,
        "description": "request_id already used for another action, filter or limit.",
    },
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody, "description": "Unknown."}}

T = TypeVar("T")


def reader_router() -> APIRouter:
    """A ``/v1`` router: a read token on every route, :data:`ERRORS` documented on each."""
    return APIRouter(
        prefix="/v1",
        dependencies=[Depends(require_reader)],
        responses=ERRORS,
        route_class=TokenJsonRoute,
    )


router = reader_router()


def found_or_404(found: T | None, what: str) -> T:
    """``found``, or a 404 ``no {what}`` when the read found nothing."""
    if found is None:
        raise HTTPException(404, f"no {what}")
    return found


def _bad_cursor(exc: BadCursor) -> RequestValidationError:
    return RequestValidationError(
        [{"type": "value_error", "loc": ("query", "cursor"), "msg": str(exc), "input": None}]
    )


@router.get("/stats", response_model=StatsOut, summary="Counts, ages, latency, publishers")
def get_stats(ctx: Ctx) -> StatsOut:
    return StatsOut.of(stats_for(ctx.engine, settings=ctx.settings, now=ctx.now()))


@router.get(
    "/confirms/outstanding",
    response_model=OutstandingPage,
    summary="In-flight publishes awaiting a broker confirm, oldest first",
)
def get_outstanding(
    ctx: Ctx,
    publisher: Annotated[Text | None, Query(description="Lease owner (publisher id).")] = None,
    exchange: Annotated[Place | None, Query(description='"" is the default exchange.')] = None,
    batch_id: Annotated[Text | None, Query()] = None,
    stream: Annotated[StreamName | None, Query()] = None,
    min_age_seconds: Annotated[
        float | None, Query(ge=0, le=MAX_AGE_SECONDS, allow_inf_nan=False)
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[Cursor | None, Query(description="next_cursor of the previous page")] = None,
) -> OutstandingPage:
    try:
        after = OutstandingKey.decode(cursor) if cursor else None
    except BadCursor as exc:
        raise _bad_cursor(exc) from None
    flt = OutstandingFilter(
        publisher=publisher,
        exchange=exchange,
        batch_id=batch_id,
        min_age_seconds=min_age_seconds,
        stream=stream,
    )
    page = outstanding_confirms(ctx.engine, now=ctx.now(), flt=flt, limit=limit, after=after)
    return OutstandingPage(
        items=[OutstandingOut.of(o) for o in page.items], next_cursor=page.next_cursor
    )


@router.get(
    "/streams",
    response_model=list[StreamLaneOut],
    summary="Streams' lanes: holder, lease, next publishing id, takeovers, rows in flight",
)
def get_streams(ctx: Ctx, stream: Annotated[StreamName | None, Query()] = None) -> Any:
    """Every lane of every stream the outbox has written to (few: a stream has a handful)."""
    return [StreamLaneOut.of(lane) for lane in list_lanes(ctx.engine, now=ctx.now(), stream=stream)]


@router.get("/batches", response_model=BatchPage, summary="Batches, newest first")
def get_batches(
    ctx: Ctx,
    status: Annotated[
        Status | None, Query(description="Only batches holding a row in this status.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        Cursor | None, Query(description="next_cursor or prev_cursor of another page")
    ] = None,
) -> BatchPage:
    try:
        at = BatchCursor.decode(cursor) if cursor else None
    except BadCursor as exc:
        raise _bad_cursor(exc) from None
    page = list_batches(ctx.engine, limit=limit, cursor=at, status=status)
    return BatchPage(
        items=[BatchOut.of(b) for b in page.items],
        next_cursor=page.older_cursor,
        prev_cursor=page.newer_cursor,
    )


BatchId = Annotated[Text, Path(description="As the Spark sink wrote it", examples=["orders:1"])]


@router.get(
    "/batches/{batch_id}", response_model=BatchOut, responses=NOT_FOUND, summary="One batch"
)
def get_batch(ctx: Ctx, batch_id: BatchId) -> BatchOut:
    return BatchOut.of(
        found_or_404(batch_summary(ctx.engine, batch_id=batch_id), f"batch {batch_id!r}")
    )


@router.get(
    "/messages/{message_id}",
    response_model=MessageOut,
    responses=NOT_FOUND,
    summary="One outbox row (body only when asked)",
)
def get_message(
    ctx: Ctx,
    message_id: Annotated[Text, Path(examples=["order-1-0"])],
    include_body: Annotated[
        bool,
        Query(
            description="Add the body, base64: its first MiB (`body_size` is the whole "
            "body's; `outbox message --body` prints it whole)."
        ),
    ] = False,
) -> MessageOut:
    found = message(
        ctx.engine, message_id=message_id, include_body=include_body, body_limit=MAX_SHOWN_BODY
    )
    return MessageOut.of(found_or_404(found, f"message {message_id!r}"))


@router.post(
    "/batches/{batch_id}/republish",
    response_model=RepublishOut,
    responses={**WRITE_ERRORS, **NOT_FOUND},
    summary="Move a batch's returned/nacked/failed rows back to pending (operator)",
)
def republish_batch(
    ctx: Ctx, actor: Operator, batch_id: BatchId, body: Annotated[BatchRepublishRequest, Body()]
) -> RepublishOut:
    if not batch_exists(ctx.engine, batch_id=batch_id):
        raise HTTPException(404, f"no batch {batch_id!r}")
    return _republish(ctx, caller=actor, flt=body.to_filter(batch_id), req=body)


@router.post(
    "/republish",
    response_model=RepublishOut,
    responses=WRITE_ERRORS,
    summary="Move returned/nacked/failed rows matching a filter back to pending (operator)",
)
def republish(ctx: Ctx, actor: Operator, body: Annotated[RepublishRequest, Body()]) -> RepublishOut:
    return _republish(ctx, caller=actor, flt=body.to_filter(), req=body)


def _republish(
    ctx: ApiContext,
    *,
    caller: Caller,
    flt: RepublishFilter,
    req: BatchRepublishRequest | RepublishRequest,
) -> RepublishOut:
    try:
        result = ctx.actions.republish(
            filter=flt,
            limit=req.limit,
            dry_run=req.dry_run,
            request_id=req.request_id,
            **caller.acting(),
        )
    except RequestIdReused as exc:
        raise HTTPException(409, str(exc)) from None
    return RepublishOut.of(result, request_id=req.request_id, flt=flt)
