"""A 1,000,000-row outbox: what `/v1/stats`, `outbox status`, `outbox failures` and `outbox purge`
run there reads indexes, never the whole table.

The statements checked are the ones production sends: captured from the engine while the
product's own functions run, then explained with their parameters (``EXPLAIN (FORMAT JSON)``, no
``ANALYZE``). The table is built the way a busy outbox looks after weeks (almost every row
confirmed, a few thousand pending, in flight, failed, returned, nacked, skipped, some with lost
confirms), then vacuumed and analysed as autovacuum would. PostgreSQL only: SQLite is the
single-machine default, where a count of its rows is what ``outbox status`` shows.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, make_url, text

from app.db import make_engine
from app.outbox import queries
from app.outbox.states import Status
from tests.outbox_clients import OutboxClients

pytestmark = pytest.mark.slow
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


@pytest.fixture(scope="module")
def large(service_urls: dict[str, str], pg_template: str) -> Iterator[Engine]:
    """One 1,000,000-row database for the module (built once: ~30 s), dropped afterwards."""
    import uuid

    from tests.conftest import drop_database

    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = f"outbox_large_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"'))
    url = make_url(service_urls["pg"]).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    try:
        build(engine)
        yield engine
    finally:
        engine.dispose()
        drop_database(admin, name)
        admin.dispose()


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


def seq_scans_on_outbox(engine: Engine, statements: list[tuple[str, Any]]) -> list[str]:
    """The statements whose plan reads ``outbox`` sequentially (with the plan's node)."""
    bad = []
    with engine.connect() as conn:
        for statement, parameters in statements:
            if not statement.lstrip().upper().startswith(("SELECT", "DELETE", "WITH")):
                continue
            plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar()
            for node in _nodes(plan[0]["Plan"]):
                if node["Node Type"] == "Seq Scan" and node.get("Relation Name") == "outbox":
                    bad.append(f"{statement}\n  -> {node}")
    return bad


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def test_stats_read_indexes_counts_exact_and_confirmed_estimated(large: Engine) -> None:
    stats, sent = captured(
        large,
        lambda: queries.read_stats(
            large,
            now=NOW,
            alive_after=15.0,
            latency_window=dt.timedelta(minutes=15),
            latency_rows=1000,
        ),
    )
    assert sum("outbox" in s for s, _ in sent) >= 6
    assert seq_scans_on_outbox(large, sent) == []
    # what it replaced reads every row (the check sees it)
    plain = [("SELECT status, count(*), sum(lost_confirms) FROM outbox GROUP BY status", {})]
    assert len(seq_scans_on_outbox(large, plain)) == 1
    odd = {st: hi - lo + 1 for lo, hi, st in ODD}
    for status in (
        Status.PENDING,
        Status.IN_FLIGHT,
        Status.FAILED,
        Status.RETURNED,
        Status.NACKED,
        Status.SKIPPED,
    ):
        assert stats.counts[status] == odd[status.value], status
    assert stats.confirmed_estimated
    exact = ROWS - sum(odd.values())
    assert abs(stats.counts[Status.CONFIRMED] - exact) <= 0.02 * exact
    assert stats.possible_duplicates == ROWS // LOST_EVERY
    assert stats.oldest_pending_age_seconds == pytest.approx(ROWS - 999_001, abs=1)
    assert stats.confirm_latency.samples == 0  # the newest rows are not confirmed yet


def test_the_drained_check_counts_open_rows_from_their_indexes(large: Engine) -> None:
    """``count_open`` (a publisher's ``--until-drained`` check, run whenever it is idle) reads
    the partial indexes of pending and in-flight rows, never the table."""
    repo = OutboxClients(large, clock=lambda: NOW)
    open_rows, sent = captured(large, repo.store.count_open)
    with large.connect() as conn:
        expected = conn.execute(
            text("SELECT count(*) FROM outbox WHERE status IN ('pending', 'in_flight')")
        ).scalar_one()
    assert open_rows == expected > 0
    assert seq_scans_on_outbox(large, sent) == []
    plain = [("SELECT count(*) FROM outbox WHERE status IN ('pending', 'in_flight')", {})]
    assert len(seq_scans_on_outbox(large, plain)) == 1  # what it replaced


def test_failures_by_cause_reads_only_the_failures(large: Engine) -> None:
    groups, sent = captured(large, lambda: queries.failures_by_cause(large, limit=50))
    assert seq_scans_on_outbox(large, sent) == []
    assert sum(g.rows for g in groups) == 500 + 500 + 200


def test_purge_walks_the_primary_key_and_deletes_exactly_the_rows_past_retention(
    large: Engine,
) -> None:
    """Retention of 11 days keeps all but the oldest 49,599 rows."""
    repo = OutboxClients(large, clock=lambda: NOW)
    retention = dt.timedelta(days=11)
    # rows 1..cutoff_id were confirmed before NOW - retention (row g: NOW - (ROWS - g) s + 9 ms)
    cutoff_id = ROWS - int(retention.total_seconds()) - 1
    would, dry = captured(large, lambda: repo.retention.count_purgeable(older_than=retention))
    assert would == cutoff_id
    assert seq_scans_on_outbox(large, dry) == []
    deleted, sent = captured(
        large, lambda: repo.retention.purge_confirmed(older_than=retention, chunk=10_000)
    )
    assert deleted == cutoff_id
    assert seq_scans_on_outbox(large, sent) == []
    # one DELETE of outbox rows per chunk (each chunk also deletes those rows' events)
    deletes = [s for s, _ in sent if re.match(r"\s*DELETE FROM outbox\b(?!_)", s, re.I)]
    assert len(deletes) <= cutoff_id // 10_000 + 1
    with large.connect() as conn:
        left = conn.execute(text("SELECT min(id), count(*) FROM outbox")).one()
        kept_old = conn.execute(
            text("SELECT count(*) FROM outbox WHERE id <= :c AND status <> 'confirmed'"),
            {"c": cutoff_id},
        ).scalar_one()
    assert left == (cutoff_id + 1, ROWS - cutoff_id) and kept_old == 0
    assert (
        repo.retention.purge_confirmed(older_than=retention, chunk=10_000) == 0
    )  # nothing left to do
