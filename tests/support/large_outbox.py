"""The 1,000,000-row outbox the plan tests explain their statements on, and how they capture
what production sends. Built once per run (about 30 s) by the session fixture ``large`` in
``tests/integration/conftest.py``; ``test_large_outbox`` and ``test_console_plans`` share it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Engine, event, text

ROWS = 1_000_000
NOW = dt.datetime(2026, 11, 24, 12, 0, tzinfo=dt.UTC)
#: rows by id range: (first id, last id, status); the rest are confirmed
ODD = [
    (400_001, 400_500, "failed"),
    (400_501, 401_000, "returned"),
    (401_001, 401_200, "nacked"),
    (401_201, 401_250, "skipped"),
    (999_001, 999_800, "pending"),
    (999_801, 1_000_000, "in_flight"),
]
LOST_EVERY = 10_000  # every 10,000th row lost a confirm once


def build(engine: Engine) -> None:
    """One row per second of the last ~11.6 days: row g written at NOW - (ROWS - g) s."""
    status = (
        "CASE "
        + " ".join(f"WHEN g BETWEEN {lo} AND {hi} THEN '{st}'" for lo, hi, st in ODD)
        + " ELSE 'confirmed' END"
    )
    with engine.begin() as conn:
        conn.execute(
            text(f"""
            INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, status,
                                attempts, lost_confirms, available_at, created_at, published_at,
                                confirmed_at, lease_owner, lease_until, last_error)
            SELECT 'm-' || g, 'b:' || (g / 10000), 'orders', 'r' || (g % 7),
                   convert_to(repeat('x', 80) || g, 'UTF8'), {status},
                   1, CASE WHEN g % {LOST_EVERY} = 0 THEN 1 ELSE 0 END,
                   :now - make_interval(secs => {ROWS} - g),
                   :now - make_interval(secs => {ROWS} - g),
                   :now - make_interval(secs => {ROWS} - g) + interval '5 ms',
                   CASE WHEN {status} = 'confirmed'
                        THEN :now - make_interval(secs => {ROWS} - g) + interval '9 ms' END,
                   CASE WHEN {status} = 'in_flight' THEN 'p1' END,
                   CASE WHEN {status} = 'in_flight' THEN :now + interval '1 minute' END,
                   CASE WHEN {status} IN ('failed', 'returned', 'nacked')
                        THEN 'exchange ''orders'': 404 NOT_FOUND' END
            FROM generate_series(1, {ROWS}) AS g
        """),
            {"now": NOW},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))


def captured(engine: Engine, run: Callable[[], Any]) -> tuple[Any, list[tuple[str, Any]]]:
    """What ``run`` returned, and every statement it sent with its parameters."""
    sent: list[tuple[str, Any]] = []

    def record(_c: Any, _cur: Any, statement: str, parameters: Any, _ctx: Any, many: bool) -> None:
        if not many:
            sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        return run(), sent
    finally:
        event.remove(engine, "before_cursor_execute", record)


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A plan node and every node under it (``EXPLAIN (FORMAT JSON)``'s ``Plan``)."""
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child)
