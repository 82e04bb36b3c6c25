"""``/healthz`` (process up) and ``/readyz`` (database, schema, broker). No token needed."""

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
    summary="Database reachable, migrations current, broker reachable",
)
async def readyz(ctx: Annotated[ApiContext, Depends(get_ctx)]) -> JSONResponse:
    timeout = ctx.settings.api_probe_timeout
    (database, migrations), broker = await asyncio.gather(
        _database(ctx, timeout), _check_broker(ctx.settings.amqp_url.get_secret_value(), timeout)
    )
    ready = Ready(
        ready=database.ok and migrations.ok and broker.ok,
        database=database, migrations=migrations, broker=broker,
    )  # fmt: skip
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


async def _check_broker(url: str, timeout: float) -> Check:
    import aiormq

    try:
        conn = await asyncio.wait_for(aiormq.connect(url), timeout)
    except Exception as exc:  # refused, auth failure, timeout: not ready
        return Check(ok=False, detail=f"unreachable: {type(exc).__name__}")
    await conn.close()
    return Check(ok=True, detail="reachable")
