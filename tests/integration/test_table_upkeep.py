"""The outbox table's upkeep as operators see it: ``outbox status`` (and ``--check``),
``GET /v1/stats``'s ``table`` and ``/metrics``' ``outbox_table_*``, read from a real PostgreSQL's
statistics after real updates and a real VACUUM; nothing of it on SQLite."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text, update

from app.api import create_app
from app.outbox.read.stats import table_upkeep
from app.outbox.schema import outbox
from app.outbox.upkeep import Upkeep
from tests.support.api import R, client_for, settings_for
from tests.support.cli import engine, env, run
from tests.support.factories import add_rows

__all__ = ["engine", "env"]  # the CLI tests' fixtures: OUTBOX_* scrubbed, the database's URL set
ROWS = 2_000


def settle(engine: Engine, until: Any) -> Upkeep:
    """The upkeep once PostgreSQL's statistics show ``until`` (a backend flushes its counters
    at most once a second): at most 10 s."""
    deadline = time.monotonic() + 10
    while True:
        with engine.connect() as conn:
            found = table_upkeep(conn)
        assert found is not None
        if until(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def alter(engine: Engine, statement: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(statement))


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
async def test_operators_see_dead_rows_autovacuum_off_and_the_vacuum_that_ends_them(
    engine: Engine, env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # off for this test's own outbox: autovacuum must not reclaim the dead rows under the test
    alter(engine, "ALTER TABLE outbox SET (autovacuum_enabled = false)")
    add_rows(engine, n=ROWS)
    with engine.begin() as conn:  # each update leaves one dead version
        conn.execute(update(outbox).values(last_error="seen"))
    found = settle(engine, lambda u: u.dead_rows >= ROWS)
    assert (found.live_rows, found.dead_rows) == (ROWS, ROWS)
    assert found.table_bytes > 0 and found.index_bytes > 0 and found.server_autovacuum
    assert found.table_settings == {  # migration 0020's, and this test's
        "autovacuum_vacuum_cost_delay": "0",
        "autovacuum_vacuum_scale_factor": "0.05",
        "autovacuum_enabled": "false",
    }
    naptime = found.naptime_seconds  # the server's, whatever it is

    rc, out, _ = run(capsys, "status")
    assert rc == 0
    assert f"{ROWS:,} live rows, {ROWS:,} dead" in out
    assert f"naptime {naptime:g} s" in out and "cost_delay=0" in out
    assert "WARNING               autovacuum is off for the outbox" in out
    rc, out, _ = run(capsys, "status", "--check")
    assert rc >= 1 and "autovacuum is off for the outbox" in out, out

    app = create_app(settings_for(env), engine=engine)
    async with client_for(app) as client:
        table = (await client.get("/v1/stats", headers=R)).json()["table"]
        assert table["live_rows"] == ROWS and table["dead_rows"] == ROWS
        assert table["table_settings"]["autovacuum_enabled"] == "false"
        assert table["naptime_seconds"] == naptime and table["server_autovacuum"] is True
        assert len(table["warnings"]) == 1 and "autovacuum_enabled" in table["warnings"][0]
        metrics = (await client.get("/metrics", headers=R)).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert samples[("outbox_table_dead_rows", ())] == ROWS
    assert samples[("outbox_table_live_rows", ())] == ROWS
    assert samples[("outbox_table_size_bytes", (("part", "table"),))] == found.table_bytes
    assert samples[("outbox_table_last_vacuum_timestamp_seconds", ())] == 0.0

    # the operator does what the runbook says: the warning goes, the vacuum shows
    alter(engine, "ALTER TABLE outbox RESET (autovacuum_enabled)")
    alter(engine, "VACUUM outbox")
    vacuumed = settle(engine, lambda u: u.dead_rows == 0 and u.last_vacuum_at is not None)
    assert vacuumed.dead_rows == 0 and vacuumed.last_vacuum_at is not None
    rc, out, _ = run(capsys, "status")
    assert "vacuumed " in out and "never vacuumed" not in out and "WARNING   " not in out
    rc, out, _ = run(capsys, "status", "--check")
    assert "autovacuum" not in out, out

    # a migration's setting gone is a note in the report, never an alarm
    alter(engine, "ALTER TABLE outbox RESET (autovacuum_vacuum_cost_delay)")
    rc, out, _ = run(capsys, "status")
    assert "note                  the outbox has no autovacuum_vacuum_cost_delay" in out
    rc, out, _ = run(capsys, "status", "--check")
    assert "autovacuum" not in out, out


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_sqlite_has_no_table_section(
    engine: Engine, env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    add_rows(engine, n=10)
    with engine.connect() as conn:
        assert table_upkeep(conn) is None
    rc, out, _ = run(capsys, "status")
    assert rc == 0 and "outbox table" not in out and "autovacuum" not in out
    async with client_for(create_app(settings_for(env), engine=engine)) as client:
        body = (await client.get("/v1/stats", headers=R)).json()
        assert body["table"] is None
        metrics = (await client.get("/metrics", headers=R)).text
    assert "outbox_table_" not in metrics
