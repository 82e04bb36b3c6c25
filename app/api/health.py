"""``/healthz`` (process up) and ``/readyz`` (database and schema). No token needed.

The API reads the database only; it never talks to the broker, so a broker outage does not take
the read-only operator API out of service (exactly when operators need it). The broker's health
is each publisher's own ``/readyz`` (:mod:`app.publisher.engine`) and ``outbox status``.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.api.context import ApiContext, get_ctx
from app.api.models import Check, Health, Ready
from app.db import current_revision

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is up")
def healthz() -> Health:
    return Health()


@router.get(
    "/readyz",
    response_model=Ready,
    responses={503: {"model": Ready, "description": "Not ready: see the failing check."}},
    summary="Database reachable, migrations current",
)
async def readyz(ctx: Annotated[ApiContext, Depends(get_ctx)]) -> JSONResponse:
    database, migrations = await _database(ctx, ctx.settings.api_probe_timeout)
    ready = Ready(ready=database.ok and migrations.ok, database=database, migrations=migrations)
    return JSONResponse(ready.model_dump(), status_code=200 if ready.ready else 503)


async def _database(ctx: ApiContext, timeout: float) -> tuple[Check, Check]:
    try:
        return await asyncio.wait_for(run_in_threadpool(_check_database, ctx), timeout)
    except TimeoutError:
        late = Check(ok=False, detail=f"no answer within {timeout:g}s")
        return late, late


def _check_database(ctx: ApiContext) -> tuple[Check, Check]:
    try:
        with ctx.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        current = current_revision(ctx.engine)
    except Exception as exc:  # any failure means "not ready"; only the class name is shown
        down = Check(ok=False, detail=f"unreachable: {type(exc).__name__}")
        return down, Check(ok=False, detail="unknown: database unreachable")
    head = ctx.head_revision
    schema = Check(
        ok=current == head,
        detail=f"at {current}" if current == head else f"at {current}, head is {head}: migrate",
    )
    return Check(ok=True, detail="reachable"), schema
