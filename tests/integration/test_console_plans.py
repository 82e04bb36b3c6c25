"""The console's searches on a 1,000,000-row outbox read indexes, never the whole table (issue
#28): the message searches by reason, by routing key and by status, the batches page both ways
and the overview's rates.

The statements checked are the ones production sends, captured from the engine while the
console's own query functions run on the table of ``tests/support/large_outbox.py`` (a row a
second for ~11.6 days, almost every row confirmed; the 500 failed rows in the middle), then
explained with their parameters (``EXPLAIN (FORMAT JSON)``, no timing). A walk of the table is
a ``Seq Scan`` of ``outbox``, or an ``Index Scan`` of its primary key with no index condition:
the plan ``ORDER BY id LIMIT 50`` got for a status search, which read 900,000 rows to find 50.
PostgreSQL only.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine

from app.api.console.base import PAGE
from app.outbox.read.batches import BatchCursor, list_batches
from app.outbox.read.messages import search_messages
from app.outbox.read.rates import RATE_WINDOW
from app.outbox.read.rates import rates as read_rates
from app.outbox.read.scopes import count_scope, search_window
from app.outbox.scope import Scope
from app.outbox.states import Status
from tests.support.large_outbox import NOW, captured, plan_nodes

pytestmark = pytest.mark.slow


def walks_of_outbox(node: dict[str, Any]) -> bool:
    if node.get("Relation Name") != "outbox":
        return False
    if node["Node Type"] == "Seq Scan":
        return True
    return node.get("Index Name") == "outbox_pkey" and "Index Cond" not in node


def explained(engine: Engine, run: Callable[[], Any]) -> tuple[Any, list[tuple[str, set[str]]]]:
    """What ``run`` returned, and per statement it sent: its text and the indexes its plan
    reads, with ``WALK`` among them when it walks the table."""
    result, sent = captured(engine, run)
    out = []
    with engine.connect() as conn:
        for statement, parameters in sent:
            if not statement.lstrip().upper().startswith(("SELECT", "WITH")):
                continue
            plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar()
            nodes = list(plan_nodes(plan[0]["Plan"]))
            used = {n["Index Name"] for n in nodes if "Index Name" in n}
            used |= {"WALK"} if any(walks_of_outbox(n) for n in nodes) else set()
            out.append((statement, used))
    return result, out


def console_search(engine: Engine, scope: Scope) -> tuple[Any, Any, Scope]:
    """The messages page's reads: its window when no index narrows the search, the page, the
    count."""
    scope = search_window(scope, now=NOW) or scope
    page = search_messages(engine, flt=scope, limit=50)
    return page, count_scope(engine, flt=scope), scope


FAILED = frozenset({Status.FAILED})


@pytest.mark.parametrize(
    ("scope", "index", "rows"),
    [
        (Scope(statuses=FAILED), "ix_outbox_aside", 50),
        (Scope(statuses=FAILED, reason="404", routing_key="r3"), "ix_outbox_aside", 50),
        (Scope(reason="404"), "ix_outbox_created", 0),  # the failures are 11 days old
        (Scope(routing_key="r3"), "ix_outbox_created", 50),
        (Scope(statuses=frozenset({Status.CONFIRMED})), "ix_outbox_created", 50),
        (Scope(batch_id="b:42"), "ix_outbox_batch_written", 50),
    ],
    ids=["status", "status-reason-key", "reason", "routing-key", "confirmed", "batch"],
)
def test_message_searches_read_the_index_of_their_scope(
    large: Engine, scope: Scope, index: str, rows: int
) -> None:
    (page, (total, _more), searched), plans = explained(large, lambda: console_search(large, scope))
    assert len(page.items) == rows
    assert total >= rows
    assert len(plans) >= 2
    for statement, used in plans:
        assert "WALK" not in used, statement
    assert index in plans[0][1] and index in plans[-1][1], plans
    assert (searched.created_after is not None) == (index == "ix_outbox_created")


@pytest.mark.parametrize("scope", [Scope(routing_key="r3"), Scope(reason="404")])
def test_the_check_sees_the_walk_that_ordering_by_id_made(large: Engine, scope: Scope) -> None:
    """The same statement ordered by ``id`` as it was: the primary key walked, filtered."""
    bounded = search_window(scope, now=NOW) or scope
    _, sent = captured(large, lambda: search_messages(large, flt=bounded, limit=50))
    statement, parameters = sent[0]
    old, n = re.subn(r"ORDER BY outbox\.id \+ %\(\w+\)s", "ORDER BY outbox.id", statement)
    assert n == 1, statement
    with large.connect() as conn:
        plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {old}", parameters).scalar()
    assert any(walks_of_outbox(node) for node in plan_nodes(plan[0]["Plan"]))


def test_batches_newest_first_walk_the_batch_index_both_ways(large: Engine) -> None:
    first, plans = explained(large, lambda: list_batches(large, limit=20))
    keys = plans[0]
    assert "WALK" not in keys[1] and "ix_outbox_batch_written" in keys[1], keys
    assert [b.batch_id for b in first.items][:3] == ["b:100", "b:99", "b:98"]
    assert first.older_cursor is not None and first.newer_cursor is None
    cursor = BatchCursor.decode(first.older_cursor)
    older, plans = explained(large, lambda: list_batches(large, limit=20, cursor=cursor))
    assert "WALK" not in plans[0][1], plans[0]
    assert [b.batch_id for b in older.items][:2] == ["b:80", "b:79"]
    back = BatchCursor.decode(older.newer_cursor or "")
    again, plans = explained(large, lambda: list_batches(large, limit=20, cursor=back))
    assert "WALK" not in plans[0][1], plans[0]
    assert [b.batch_id for b in again.items] == [b.batch_id for b in first.items]


def test_batches_page_counts_read_no_whole_table(large: Engine) -> None:
    """The console's list (``timings=False``) counts its 50 batches, half of this table, from
    indexes: the rows by ``ix_outbox_batch_written``, the unsettled ones by the partial
    indexes. The full summary (timings: the REST API's and the CLI's list) reads the rows."""
    page, plans = explained(large, lambda: list_batches(large, limit=PAGE, timings=False))
    assert sum(b.rows for b in page.items) > 400_000
    for statement, used in plans:
        assert "WALK" not in used, statement
    assert any("ix_outbox_batch_written" in used for _, used in plans)


def test_overview_rates_read_the_samples_not_the_rows(large: Engine) -> None:
    """The overview's rates and latency read ``outbox_samples`` by time (its primary key), one
    statement, never the outbox: their cost is the window's samples, whatever the traffic."""
    rates, plans = explained(large, lambda: read_rates(large, now=NOW))
    assert len(plans) == 1
    (statement, used) = plans[0]
    assert "outbox_samples" in statement and " outbox " not in statement.replace("\n", " ")
    assert used <= {"pk_outbox_samples"}
    assert dt.timedelta(minutes=len(rates.written)) == RATE_WINDOW
    assert not rates.sampled  # the table was built by hand: no publisher sampled it


#: Every console page, as an operator opens them on this table (rows of
#: ``tests/support/large_outbox.py``).
CONSOLE_PAGES = (
    "/ui",
    "/ui/failures",
    "/ui/messages?status=failed",
    "/ui/messages?reason=404",
    "/ui/messages?routing_key=r3",
    "/ui/batches",
    "/ui/batches?status=failed",
    "/ui/batches/b:50",
    "/ui/messages/m-400100",
    "/ui/outstanding",
    "/ui/parked",
    "/ui/rejects",
    "/ui/audit",
)


def test_no_console_page_walks_the_table(large: Engine) -> None:
    """Each page rendered by the console itself (its app, signed in), every statement it sent
    explained: none walks the 1,000,000-row outbox."""
    import asyncio

    import httpx
    from pydantic import SecretStr

    from app.api import create_app
    from app.settings import Settings

    operator = "plans-oper-Wm5Qz8Kd2Xr7Nc4Vb9Ht3Lp6Gy1Fs0"
    settings = Settings(
        database_url=SecretStr(large.url.render_as_string(hide_password=False)),
        api_token=SecretStr("plans-read-Hq4Zc9Lw2Tm7Xv5Bn8Kd3Rp6Gy1Fs0"),
        operator_token=SecretStr(operator),
        amqp_url=SecretStr("amqp://guest:guest@127.0.0.1:1/"),
    )
    app = create_app(settings, clock=lambda: NOW, engine=large)
    base = "http://outbox.plans"

    async def render() -> dict[str, int]:
        codes = {}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base) as client:
            signed = await client.post(
                "/ui/login", data={"token": operator, "next": "/ui"}, headers={"origin": base}
            )
            assert signed.status_code in (200, 303) and client.cookies
            for path in CONSOLE_PAGES:
                codes[path] = (await client.get(path)).status_code
        return codes

    codes, plans = explained(large, lambda: asyncio.run(render()))
    assert set(codes.values()) == {200}, codes
    assert len(plans) > len(CONSOLE_PAGES)
    walks = [statement for statement, used in plans if "WALK" in used]
    assert not walks, walks
