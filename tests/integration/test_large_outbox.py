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
from typing import Any

import pytest
from sqlalchemy import Engine, text

from app.outbox.read.failures import failures_by_cause
from app.outbox.read.stats import read_stats
from app.outbox.states import Status
from tests.support.large_outbox import LOST_EVERY, NOW, ODD, ROWS, captured, plan_nodes
from tests.support.outbox_clients import OutboxClients

pytestmark = pytest.mark.slow


def seq_scans_on_outbox(engine: Engine, statements: list[tuple[str, Any]]) -> list[str]:
    """The statements whose plan reads ``outbox`` sequentially (with the plan's node)."""
    bad = []
    with engine.connect() as conn:
        for statement, parameters in statements:
            if not statement.lstrip().upper().startswith(("SELECT", "DELETE", "WITH")):
                continue
            plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar()
            for node in plan_nodes(plan[0]["Plan"]):
                if node["Node Type"] == "Seq Scan" and node.get("Relation Name") == "outbox":
                    bad.append(f"{statement}\n  -> {node}")
    return bad


def test_stats_read_indexes_counts_exact_and_confirmed_estimated(large: Engine) -> None:
    stats, sent = captured(
        large,
        lambda: read_stats(
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
    # what the publisher asks: pending rows due within backoff_max (a range of ix_outbox_due)
    soon, sent = captured(large, lambda: repo.store.count_open(due_within=60.0))
    assert 0 < soon <= open_rows
    assert seq_scans_on_outbox(large, sent) == []
    plain = [("SELECT count(*) FROM outbox WHERE status IN ('pending', 'in_flight')", {})]
    assert len(seq_scans_on_outbox(large, plain)) == 1  # what it replaced


def test_failures_by_cause_reads_only_the_failures(large: Engine) -> None:
    groups, sent = captured(large, lambda: failures_by_cause(large, limit=50))
    assert seq_scans_on_outbox(large, sent) == []
    assert sum(g.rows for g in groups) == 500 + 500 + 200


def test_purge_walks_the_primary_key_and_deletes_exactly_the_rows_past_retention(
    large_copy: Engine,
) -> None:
    """Retention of 11 days keeps all but the oldest 49,599 rows (on a copy of the table: the
    other tests read it whole)."""
    large = large_copy
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


class _Recording:
    """A psycopg connection that keeps every statement sent through ``execute``."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.sent: list[tuple[str, Any]] = []

    def execute(self, statement: str, parameters: Any) -> Any:
        self.sent.append((statement, parameters))
        return self.conn.execute(statement, parameters)


def test_the_spark_writers_wait_reads_a_batch_through_its_index(large: Engine) -> None:
    """``wait="confirmed"`` polls a batch's rows per status, looks for rows blocked behind a
    failed row of their key and reads the first reasons: through the batch's own index
    (``ix_outbox_batch_written``), never the table. Batch ``b:40`` holds the failures,
    ``b:99`` the pending and in-flight rows."""
    from spark_writer.db import PostgresStore
    from spark_writer.dburl import pg_conninfo
    from spark_writer.watch import BatchRows

    store = PostgresStore(pg_conninfo(large.url.render_as_string(hide_password=False)))
    recording = _Recording(store.conn)
    store.conn = recording
    try:
        failed = BatchRows(store, "b:40")
        counts, reasons = failed.poll().counts, failed.reasons()
        open_rows = BatchRows(store, "b:99")
        waiting, blocked = open_rows.poll(), open_rows.blocked()
    finally:
        recording.conn.close()
    assert counts == {
        "confirmed": 8750,
        "failed": 500,
        "returned": 500,
        "nacked": 200,
        "skipped": 50,
    }
    assert reasons[0][:3] == ("failed", "exchange 'orders': 404 NOT_FOUND", 500)
    assert waiting.counts == {"confirmed": 9001, "pending": 800, "in_flight": 199}
    assert waiting.retrying == 800 and blocked == 0  # claimed once (attempts 1); no keys
    assert len(recording.sent) == 4
    assert seq_scans_on_outbox(large, recording.sent) == []
