"""The outbox table's upkeep advice (``outbox status``, ``/v1/stats``): pure rules on
PostgreSQL's figures; warnings for what is wrong now, notes for settings that go wrong under load.
The figures themselves are read from a real PostgreSQL in tests/integration/test_table_upkeep.py."""

from __future__ import annotations

import dataclasses
import datetime as dt

from app.outbox.health import Level, verdict
from app.outbox.upkeep import Advice, Upkeep, advice
from tests.support.health import NOW, stats

OURS = {"autovacuum_vacuum_cost_delay": "0", "autovacuum_vacuum_scale_factor": "0.05"}
HEALTHY = Upkeep(
    live_rows=500_000,
    dead_rows=60_000,
    table_bytes=800_000_000,
    index_bytes=270_000_000,
    last_vacuum_at=NOW - dt.timedelta(seconds=20),
    last_analyze_at=NOW - dt.timedelta(seconds=20),
    autovacuum_runs=120,
    vacuum_running=False,
    server_autovacuum=True,
    naptime_seconds=15.0,
    table_settings=OURS,
)


def test_a_table_kept_as_advised_says_nothing() -> None:
    assert advice(HEALTHY, now=NOW) == Advice(warnings=[], notes=[])


def test_autovacuum_off_on_the_server_or_for_the_table_is_a_warning() -> None:
    off = advice(dataclasses.replace(HEALTHY, server_autovacuum=False), now=NOW)
    assert len(off.warnings) == 1 and "autovacuum is off on the server" in off.warnings[0]
    assert "60,000 dead rows" in off.warnings[0]
    for value in ("false", "off", "FALSE", "0"):
        table = dataclasses.replace(HEALTHY, table_settings={**OURS, "autovacuum_enabled": value})
        (said,) = advice(table, now=NOW).warnings
        assert "autovacuum is off for the outbox" in said and "RESET (autovacuum_enabled)" in said
    on = dataclasses.replace(HEALTHY, table_settings={**OURS, "autovacuum_enabled": "true"})
    assert advice(on, now=NOW).warnings == []


def test_dead_rows_past_the_live_ones_and_the_floor_are_a_warning() -> None:
    behind = dataclasses.replace(
        HEALTHY, dead_rows=700_000, last_vacuum_at=NOW - dt.timedelta(minutes=25)
    )
    (said,) = advice(behind, now=NOW).warnings
    assert said.startswith("700,000 dead rows against 500,000 live (last vacuumed 25 min ago)")
    running = dataclasses.replace(behind, vacuum_running=True, last_vacuum_at=None)
    (said,) = advice(running, now=NOW).warnings
    assert "(never vacuumed, a vacuum running now)" in said
    # a small outbox's dead rows are cheap; a busy one's between two visits are not "behind"
    small = dataclasses.replace(HEALTHY, live_rows=1_000, dead_rows=90_000)
    assert advice(small, now=NOW).warnings == []
    busy = dataclasses.replace(HEALTHY, live_rows=2_000_000, dead_rows=400_000)
    assert advice(busy, now=NOW).warnings == []


def test_settings_that_let_dead_rows_pile_up_are_notes() -> None:
    bare = dataclasses.replace(HEALTHY, table_settings={}, naptime_seconds=60.0)
    said = advice(bare, now=NOW)
    assert said.warnings == []
    missing, naptime = said.notes
    assert "no autovacuum_vacuum_cost_delay or autovacuum_vacuum_scale_factor" in missing
    assert "migration 0020" in missing
    assert naptime.startswith("autovacuum_naptime is 60 s") and "15 s advised" in naptime
    one = dataclasses.replace(HEALTHY, table_settings={"autovacuum_vacuum_cost_delay": "2"})
    (only,) = advice(one, now=NOW).notes
    assert "no autovacuum_vacuum_scale_factor of its own" in only


def test_the_verdict_warns_on_the_tables_warnings_not_on_its_notes() -> None:
    quiet = dataclasses.replace(stats(), upkeep=dataclasses.replace(HEALTHY, table_settings={}))
    assert verdict(quiet).level is Level.OK
    off = dataclasses.replace(stats(), upkeep=dataclasses.replace(HEALTHY, server_autovacuum=False))
    found = verdict(off)
    assert found.level is Level.WARNING and "autovacuum is off on the server" in found.line()
