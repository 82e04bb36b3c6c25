"""Rows the Spark writer refused (reject mode): counts by reason, then the rows, newest first."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import HTMLResponse

from app.api.console.base import PAGE, int_param, page_router, param, render, session_of
from app.api.context import get_ctx
from app.outbox.read.rejects import reject_summary, writer_rejects

router = page_router()

#: Characters of a refused row shown in the list (the whole row: ``outbox rejects --json``).
ROW_SHOWN = 300


@router.get("/rejects")
def rejects(request: Request) -> HTMLResponse:
    session = session_of(request)
    batch_id = param(request, "batch_id")
    before = int_param(request, "before")
    engine = get_ctx(request).engine
    summary = reject_summary(engine, batch_id=batch_id)
    rows = writer_rejects(engine, batch_id=batch_id, limit=PAGE, before=before or None)
    nxt = rows[-1].id if len(rows) == PAGE else None
    return render(
        request,
        "rejects.html",
        session=session,
        summary=summary,
        rows=rows,
        batch_id=batch_id,
        before=before,
        next_before=nxt,
        row_shown=ROW_SHOWN,
    )
