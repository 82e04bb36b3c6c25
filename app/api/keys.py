"""``/v1/keys``: ordering keys parked behind a terminal failure, and the operator's way out.

A key is *parked* when its head (its first row not yet confirmed or skipped) ended ``returned``,
``nacked`` or ``failed``: the later rows of the key wait rather than overtake it. The operator
either republishes the blocking row (``POST /v1/republish`` with ``ordering_key``: it goes first
and the key resumes behind it) or skips it (``POST /v1/messages/{id}/skip``, audited), which
releases the key.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import Body, HTTPException, Path, Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.api.models import OPERATOR_TEXT_PATTERN, ParkedKeyOut, ParkedKeyPage, Text, utf8_text
from app.api.v1 import NOT_FOUND, WRITE_ERRORS, Ctx, Operator, found_or_404, reader_router
from app.outbox.actions import MAX_REASON, CannotSkip, SkipResult
from app.outbox.read.keys import parked_keys
from app.outbox.read.messages import message

log = logging.getLogger("app.api.keys")
router = reader_router()


class SkipRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Annotated[
        str,
        Field(min_length=1, max_length=MAX_REASON, pattern=OPERATOR_TEXT_PATTERN),
        AfterValidator(utf8_text),
    ] = Field(
        description="Why this row will not be delivered (kept in the audit trail); one line of "
        "text, no control, line-separator or bidirectional-override characters."
    )


class SkipOut(BaseModel):
    message_id: str
    previous_status: str
    ordering_key: str | None
    released: int = Field(description="Rows of the key that were waiting behind it.")
    audit_id: int

    @classmethod
    def of(cls, r: SkipResult) -> SkipOut:
        return cls(
            message_id=r.message_id,
            previous_status=r.previous.value,
            ordering_key=r.ordering_key,
            released=r.released,
            audit_id=r.audit_id,
        )


@router.get("/keys/parked", response_model=ParkedKeyPage, summary="Ordering keys parked")
def get_parked_keys(
    ctx: Ctx,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[Text | None, Query(description="Last key of the previous page.")] = None,
) -> ParkedKeyPage:
    found = parked_keys(ctx.engine, limit=limit, after=after)
    nxt = found[-1].ordering_key if len(found) == limit else None
    return ParkedKeyPage(items=[ParkedKeyOut.of(k) for k in found], next_after=nxt)


@router.post(
    "/messages/{message_id}/skip",
    response_model=SkipOut,
    responses={**WRITE_ERRORS, **NOT_FOUND, 409: {"description": "Not a terminal failure."}},
    summary="Skip a terminal failure: not delivered, its ordering key goes on (operator)",
)
def skip_message(
    ctx: Ctx,
    actor: Operator,
    message_id: Annotated[Text, Path()],
    body: Annotated[SkipRequest, Body()],
) -> SkipOut:
    found_or_404(message(ctx.engine, message_id=message_id), f"message {message_id!r}")
    try:
        result = ctx.actions.skip(message_id=message_id, reason=body.reason, **actor.acting())
    except CannotSkip as exc:
        raise HTTPException(409, str(exc)) from None
    log.info(
        "%s skipped %r (was %s, key %r, %d rows released), audit %d",
        actor.actor,
        message_id,
        result.previous.value,
        result.ordering_key,
        result.released,
        result.audit_id,
    )
    return SkipOut.of(result)
