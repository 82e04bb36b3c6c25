"""Operator actions, newest first."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import HTMLResponse

from app.api.console.base import PAGE, int_param, page_router, render, session_of
from app.api.context import get_ctx
from app.outbox.read.audit import audit_trail

router = page_router()


@router.get("/audit")
def audit(request: Request) -> HTMLResponse:
    session = session_of(request)
    before = int_param(request, "before")
    entries = audit_trail(get_ctx(request).engine, limit=PAGE, before=before or None)
    nxt = entries[-1].id if len(entries) == PAGE else None
    return render(request, "audit.html", session=session, entries=entries, next_before=nxt)
