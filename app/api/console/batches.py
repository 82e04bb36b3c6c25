"""Batches: the list and one batch."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import HTMLResponse

from app.api.console.base import (
    MAX_FIELD,
    PAGE,
    ConsoleError,
    check_path_id,
    cursor_param,
    page_router,
    render,
    session_of,
    status_param,
)
from app.api.context import get_ctx
from app.outbox.read.batches import BatchCursor, batch_summary, list_batches
from app.outbox.states import TERMINAL_FAILURES, Status

router = page_router()


@router.get("/batches")
def batches(request: Request) -> HTMLResponse:
    session = session_of(request)
    ctx = get_ctx(request)
    status = status_param(request)
    at = cursor_param(request, BatchCursor.decode)
    page = list_batches(ctx.engine, limit=PAGE, cursor=at, status=status, timings=False)
    return render(
        request, "batches.html", session=session, page=page, status=status, statuses=list(Status)
    )


@router.get("/batches/{batch_id}")
def batch(request: Request, batch_id: str) -> HTMLResponse:
    session = session_of(request)
    check_path_id(batch_id, "batch id")
    found = batch_summary(get_ctx(request).engine, batch_id=batch_id[:MAX_FIELD])
    if found is None:
        raise ConsoleError(404, f"There is no batch {batch_id!r}.")
    failures = sum(found.counts.get(s, 0) for s in TERMINAL_FAILURES)
    return render(
        request, "batch.html", session=session, b=found, failures=failures, statuses=list(Status)
    )
