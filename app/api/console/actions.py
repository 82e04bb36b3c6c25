"""The operator's actions: republish (form, preview, confirmation) and skip."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from app.api.console.base import (
    CHUNK,
    REPUBLISH_STATUSES,
    ConsoleError,
    acting,
    empty_conditions,
    log,
    one,
    page_router,
    param,
    render,
    session_of,
    who_acts,
)
from app.api.console.messages import _as_fields
from app.api.context import client_address, get_ctx
from app.api.models import RepublishRequest
from app.outbox.actions import MAX_REASON, CannotSkip, RequestIdReused, has_control_characters
from app.outbox.scope import CRITERIA

router = page_router()


#: The conditions a republish form may carry (``cause`` is read as sent, spaces included).
FILTER_FIELDS = tuple(name for name in CRITERIA if name != "cause")


def _republish_request(
    form: Mapping[str, list[str]], *, request_id: str, dry_run: bool
) -> RepublishRequest:
    doc: dict[str, Any] = {"request_id": request_id, "dry_run": dry_run, "limit": CHUNK}
    for name in FILTER_FIELDS:
        value = one(form, name)
        if value is not None:
            doc[name] = value
    doc |= empty_conditions(form.get("empty", []), doc)
    if "cause" in form:
        doc["cause"] = form["cause"][0]
    statuses = [s for s in form.get("statuses", []) if s]
    unknown = [s for s in statuses if s not in REPUBLISH_STATUSES]
    if unknown:
        raise ConsoleError(
            400, f"Only returned, nacked or failed rows are republished, not {unknown[0]!r}."
        )
    if statuses:
        doc["statuses"] = sorted(set(statuses))
    if one(form, "all") == "yes":
        doc["all"] = True
    try:
        return RepublishRequest.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        raise ConsoleError(422, f"The republish filter is not valid: {problems}.") from None


def _problem(error: Mapping[str, Any]) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "__root__")
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _filter_fields(req: RepublishRequest) -> dict[str, Any]:
    """The filter as form fields again (for the confirmation form): every condition."""
    flt = req.to_filter()
    fields: dict[str, Any] = {"statuses": sorted(s.value for s in flt.statuses), **_as_fields(flt)}
    if req.all_failures:
        fields["all"] = "yes"
    return fields


@router.get("/republish")
def republish_form(request: Request) -> HTMLResponse:
    session = session_of(request)
    preset = {name: param(request, name) or "" for name in (*FILTER_FIELDS, "status")}
    return render(
        request, "republish_form.html", session=session, preset=preset, statuses=REPUBLISH_STATUSES
    )


@router.post("/republish/preview")
async def republish_preview(request: Request) -> HTMLResponse:
    session, form = await acting(request)
    ctx = get_ctx(request)
    req = _republish_request(form, request_id=f"ui-{uuid.uuid4()}", dry_run=True)
    flt = req.to_filter()
    result = await run_in_threadpool(
        ctx.actions.republish,
        actor=session.principal,
        filter=flt,
        limit=req.limit,
        dry_run=True,
        principal=session.principal,
        client_addr=client_address(request),
    )
    return render(
        request,
        "republish_preview.html",
        session=session,
        result=result,
        fields=_filter_fields(req),
        request_id=req.request_id,
        described=flt.describe(),
    )


@router.post("/republish")
async def republish(request: Request) -> HTMLResponse:
    session, form = await acting(request)
    ctx = get_ctx(request)
    request_id = one(form, "request_id")
    if not request_id:
        raise ConsoleError(400, "The confirmation has no request id: start from the preview.")
    req = _republish_request(form, request_id=request_id, dry_run=False)
    flt = req.to_filter()
    who = who_acts(form, session, request)
    try:
        result = await run_in_threadpool(
            ctx.actions.republish,
            filter=flt,
            limit=req.limit,
            dry_run=False,
            request_id=req.request_id,
            **who,
        )
    except RequestIdReused as exc:
        raise ConsoleError(409, str(exc)) from None
    log.info(
        "console: republish %s by %s (%s) moved %d of %d matching rows, audit %s, filter %r",
        req.request_id,
        who["actor"],
        session.principal,
        result.count,
        result.matched,
        result.audit_id,
        flt.as_json(),
    )
    return render(
        request,
        "republish_done.html",
        session=session,
        result=result,
        request_id=req.request_id,
        described=flt.describe(),
        left=max(0, result.matched - result.count),
        fields=_filter_fields(req),
    )


@router.post("/skip")
async def skip(request: Request) -> HTMLResponse:
    """Skip one terminal failure (it will not be delivered; its key's parked rows go on)."""
    session, form = await acting(request)
    message_id = one(form, "message_id")
    reason = one(form, "reason")
    if message_id is None or "\x00" in message_id:
        raise ConsoleError(400, "Say which message to skip.")
    if reason is None or len(reason) > MAX_REASON or has_control_characters(reason):
        raise ConsoleError(
            400,
            f"A skip needs a reason: one line of at most {MAX_REASON} "
            "characters, without control characters.",
        )
    who = who_acts(form, session, request)
    try:
        result = await run_in_threadpool(
            get_ctx(request).actions.skip, message_id=message_id, reason=reason, **who
        )
    except CannotSkip as exc:
        raise ConsoleError(409, str(exc)) from None
    log.info(
        "console: skip of %r by %s (%s), was %s, key %r: %d rows released, audit %s",
        message_id,
        who["actor"],
        session.principal,
        result.previous.value,
        result.ordering_key,
        result.released,
        result.audit_id,
    )
    return render(request, "skip_done.html", session=session, result=result)
