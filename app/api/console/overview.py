"""The overview (verdict, counts, rates), the outstanding confirms with the streams' lanes,
and the parked keys."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import HTMLResponse

from app import rates as charts
from app.api.console.base import (
    PAGE,
    ConsoleError,
    cursor_param,
    page_router,
    param,
    render,
    session_of,
)
from app.api.context import get_ctx
from app.outbox import health
from app.outbox.read.keys import parked_keys as read_parked_keys
from app.outbox.read.outstanding import (
    OutstandingFilter,
    OutstandingKey,
    list_lanes,
    outstanding_confirms,
)
from app.outbox.read.rates import Rates
from app.outbox.read.rates import rates as read_rates
from app.outbox.read.rejects import reject_count
from app.outbox.read.stats import OutboxStats, publisher_rows, stats_for
from app.outbox.states import TERMINAL_FAILURES, Status
from app.outbox.upkeep import advice

router = page_router()

#: The auto refresh intervals offered (seconds); none: paused.
REFRESH = (10, 30, 60)


def refresh_param(request: Request) -> int | None:
    """``?refresh=N``: reload the overview every N seconds (a ``<meta http-equiv=refresh>``,
    which the console's CSP needs nothing for)."""
    value = param(request, "refresh")
    if value is None:
        return None
    if value not in {str(r) for r in REFRESH}:
        offered = ", ".join(str(r) for r in REFRESH)
        raise ConsoleError(400, f"Auto refresh runs every {offered} seconds, not {value!r}.")
    return int(value)


def rates_view(rates: Rates, stats: OutboxStats) -> tuple[charts.Chart, charts.Trend]:
    """The chart of the last hour and the trend in words. The backlog is what waits for a
    publisher: pending rows not delayed and not parked, and the rows in flight."""
    pending = stats.counts.get(Status.PENDING, 0) - stats.delayed - stats.parked
    backlog = max(0, pending) + stats.counts.get(Status.IN_FLIGHT, 0)
    chart = charts.chart(
        [("written", rates.written), ("confirmed", rates.confirmed), ("failed", rates.failed)]
    )
    trend = charts.trend(
        backlog=backlog,
        written=rates.written,
        confirmed=rates.confirmed,
        failed=rates.failed,
        sampled=rates.sampled,
    )
    return chart, trend


@router.get("")
def overview(request: Request) -> HTMLResponse:
    session = session_of(request)
    refresh = refresh_param(request)
    ctx = get_ctx(request)
    stats = stats_for(ctx.engine, settings=ctx.settings, now=ctx.now())
    parked_keys = len(read_parked_keys(ctx.engine, limit=101))
    rejects, rejects_more = reject_count(ctx.engine)
    rates = read_rates(ctx.engine, now=stats.at)
    chart, trend = rates_view(rates, stats)
    latency = charts.latency_chart([("p50", rates.latency_p50_ms), ("p99", rates.latency_p99_ms)])
    return render(
        request,
        "overview.html",
        session=session,
        stats=stats,
        rates=rates,
        chart=chart,
        latency=latency,
        trend=trend,
        refresh=refresh,
        refresh_choices=REFRESH,
        rejects=rejects,
        rejects_more=rejects_more,
        verdict=health.verdict(stats),
        statuses=list(Status),
        parked_keys=parked_keys,
        failures=sum(stats.counts.get(s, 0) for s in TERMINAL_FAILURES),
        # the table's warnings are in the verdict; its notes beside its figures
        upkeep_notes=advice(stats.upkeep, now=stats.at).notes if stats.upkeep else [],
    )


@router.get("/outstanding")
def outstanding(request: Request) -> HTMLResponse:
    session = session_of(request)
    ctx = get_ctx(request)
    after = cursor_param(request, OutstandingKey.decode)
    page = outstanding_confirms(
        ctx.engine, now=ctx.now(), flt=OutstandingFilter(), limit=PAGE, after=after
    )
    with ctx.engine.connect() as conn:
        known = publisher_rows(conn, now=ctx.now(), alive_after=ctx.alive_after)
    alive = {p.publisher_id for p in known if p.alive}
    lanes = list_lanes(ctx.engine, now=ctx.now())
    return render(request, "outstanding.html", session=session, page=page, alive=alive, lanes=lanes)


@router.get("/parked")
def parked(request: Request) -> HTMLResponse:
    session = session_of(request)
    after = param(request, "after")
    keys = read_parked_keys(get_ctx(request).engine, limit=PAGE, after=after)
    nxt = keys[-1].ordering_key if len(keys) == PAGE else None
    return render(request, "parked.html", session=session, keys=keys, next_after=nxt)
