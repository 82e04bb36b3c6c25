"""The outbox table's upkeep on PostgreSQL: its size, its dead rows, when it was last vacuumed,
and the settings that decide how soon autovacuum comes again. Pure: the figures (read by
:func:`app.outbox.read.stats.table_upkeep`) in, an operator's warnings and notes out.

The outbox is a queue: every row leaves three dead versions behind it (the claim's update, the
confirm's, the purge's delete). Autovacuum's defaults are set for tables that change slowly;
behind, the table grows past what the retention keeps and every claim walks the dead entries
(docs/operations.md, "Autovacuum"). ``outbox status``, ``GET /v1/stats`` and ``/metrics`` show
these figures so that an operator sees that before the latency does.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

#: The outbox's own storage parameters that migration 0020 sets (an operator may change them;
#: their absence is worth a note, not an alarm).
OWN_SETTINGS = ("autovacuum_vacuum_cost_delay", "autovacuum_vacuum_scale_factor")
#: ``autovacuum_naptime`` above this holds that long of the outbox's dead rows between visits.
NAPTIME_ADVISED_SECONDS = 15.0
#: Dead rows are "behind" only past this many AND past the live rows: a small outbox's dead
#: rows are cheap, and between two visits a busy one holds 10-25 % dead (the soak).
DEAD_ROWS_FLOOR = 100_000
_OFF = {"false", "off", "no", "0"}


@dataclass(frozen=True, slots=True)
class Upkeep:
    """PostgreSQL's figures of the outbox table (``pg_stat_user_tables``, ``pg_class``,
    ``pg_settings``). Live and dead rows are the statistics collector's estimates."""

    live_rows: int
    dead_rows: int
    table_bytes: int
    index_bytes: int
    #: the latest VACUUM, by autovacuum or by hand (None: never since the statistics began)
    last_vacuum_at: dt.datetime | None
    last_analyze_at: dt.datetime | None
    autovacuum_runs: int
    #: a VACUUM of the outbox runs now (``pg_stat_progress_vacuum``; autovacuum's workers are
    #: visible only to a role with ``pg_read_all_stats``, else this stays False while they run)
    vacuum_running: bool
    #: the server's ``autovacuum`` and ``autovacuum_naptime``
    server_autovacuum: bool
    naptime_seconds: float
    #: the outbox's own ``autovacuum_*`` storage parameters (``ALTER TABLE outbox SET``)
    table_settings: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Advice:
    #: something is wrong now: ``outbox status --check`` says WARNING
    warnings: list[str]
    #: a setting that will make it go wrong under load: shown, not alarmed on
    notes: list[str]


def advice(u: Upkeep, *, now: dt.datetime) -> Advice:
    """What an operator should know about the outbox's upkeep, worst first."""
    warnings: list[str] = []
    notes: list[str] = []
    if not u.server_autovacuum:
        warnings.append(
            f"autovacuum is off on the server: the outbox's {u.dead_rows:,} dead rows are "
            "reclaimed only by a VACUUM someone runs (docs/operations.md, Autovacuum)"
        )
    if u.table_settings.get("autovacuum_enabled", "true").lower() in _OFF:
        warnings.append(
            "autovacuum is off for the outbox (autovacuum_enabled = false): its dead rows are "
            "reclaimed only by a VACUUM someone runs; ALTER TABLE outbox RESET "
            "(autovacuum_enabled)"
        )
    if u.dead_rows > max(DEAD_ROWS_FLOOR, u.live_rows):
        last = (
            f"last vacuumed {_ago(u.last_vacuum_at, now)} ago"
            if u.last_vacuum_at is not None
            else "never vacuumed"
        )
        running = ", a vacuum running now" if u.vacuum_running else ""
        warnings.append(
            f"{u.dead_rows:,} dead rows against {u.live_rows:,} live ({last}{running}): "
            "autovacuum is behind, and every claim walks the dead index entries"
        )
    missing = [name for name in OWN_SETTINGS if name not in u.table_settings]
    if missing:
        notes.append(
            f"the outbox has no {' or '.join(missing)} of its own (migration 0020 sets them): "
            "at a few thousand rows a second it outgrows what the retention keeps"
        )
    if u.naptime_seconds > NAPTIME_ADVISED_SECONDS:
        notes.append(
            f"autovacuum_naptime is {u.naptime_seconds:g} s: the outbox holds up to that long "
            f"of dead rows between two visits ({NAPTIME_ADVISED_SECONDS:g} s advised)"
        )
    return Advice(warnings, notes)


def _ago(then: dt.datetime, now: dt.datetime) -> str:
    seconds = max(0.0, (now - then).total_seconds())
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
