"""Terminal failures, one group per cause with its routing keys beneath."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import HTMLResponse

from app.api.console.base import (
    REPUBLISH_STATUSES,
    ConsoleError,
    int_param,
    page_router,
    render,
    session_of,
)
from app.api.context import get_ctx
from app.outbox.read.failures import failures_page

router = page_router()


#: Causes on one page of the failures view.
CAUSES_PAGE = 50
#: The largest offset a page may ask for: PostgreSQL's OFFSET is a bigint, and a page number of
#: 18 digits times CAUSES_PAGE overflowed it (a 500 and 16.7 KB of logged SQL, issue 48).
MAX_OFFSET = 2**63 - 1


@router.get("/failures")
def failures(request: Request) -> HTMLResponse:
    session = session_of(request)
    number = int_param(request, "page") or 1
    if (number - 1) * CAUSES_PAGE > MAX_OFFSET:  # past any outbox: the offset would overflow
        raise ConsoleError(404, f"There is no page {number} of the failures.")
    found = failures_page(
        get_ctx(request).engine, limit=CAUSES_PAGE, offset=(number - 1) * CAUSES_PAGE
    )
    last = max(1, -(-found.total_groups // CAUSES_PAGE))
    if number > last:
        raise ConsoleError(404, f"There is no page {number} of the failures: there are {last}.")
    return render(
        request,
        "failures.html",
        session=session,
        found=found,
        number=number,
        last=last,
        statuses=REPUBLISH_STATUSES,
    )
