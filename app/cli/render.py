"""How the commands show things to people: tables, durations, the status report."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from app.cli.common import json_compact
from app.cli_output import cell, plain_table, say, show_table
from app.outbox.read.audit import AuditEntry
from app.outbox.read.batches import BatchSummary
from app.outbox.read.failures import FailureGroup
from app.outbox.read.messages import MessageRecord
from app.outbox.read.outstanding import OutstandingConfirm, StreamLane
from app.outbox.read.rejects import WriterReject
from app.outbox.read.stats import OutboxStats
from app.outbox.scope import RepublishFilter
from app.outbox.states import Status
from app.outbox.upkeep import Upkeep, advice


def duration(seconds: float | None) -> str:
    """``None`` -> "-"; else a short human duration (ms below one second)."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n][:2]
    return " ".join(shown) or "0s"


#: Beside the possible duplicates: whose they are.
STREAMS_APART = " (rows for exchanges; a stream's rows are exactly once)"


def render_stats(s: OutboxStats) -> str:
    lat = s.confirm_latency
    counts = [(status.value, n) for status, n in s.counts.items()]
    pubs = _publisher_rows(s)
    lines = [
        f"outbox at {cell(s.at)} UTC",
        "",
        plain_table(["status", "rows"], [*counts, ("total", sum(s.counts.values()))]),
        "",
        *(
            ["confirmed is PostgreSQL's estimate (a large outbox is not counted row by row)"]
            if s.confirmed_estimated
            else []
        ),
        f"oldest pending        {duration(s.oldest_pending_age_seconds)}",
        f"oldest unconfirmed    {duration(s.oldest_in_flight_age_seconds)}",
        f"confirm latency       p50 {duration(lat.p50)}, p90 {duration(lat.p90)}, "
        f"p99 {duration(lat.p99)} ({lat.samples} confirms, last {duration(lat.window_seconds)})",
        f"possible duplicates   {s.possible_duplicates}{STREAMS_APART}",
        f"operator republished  {s.operator_republished}",
        f"parked (uncommitted)  {s.parked}"
        + (f", oldest {duration(s.oldest_parked_age_seconds)}" if s.parked else ""),
        f"delayed (not due yet) {s.delayed}" + _next_delayed(s),
        *(
            [f"{name:<21} {value}" for name, value in upkeep_lines(s.upkeep, s.at)]
            if s.upkeep is not None
            else []
        ),
        "",
        f"publishers: {s.publishers_alive} alive of {len(s.publishers)} known",
    ]
    if s.blocked_publishers:
        reasons = {p.report.blocked_reason for p in s.publishers if p.blocked and p.report}
        why = ", ".join(sorted(r for r in reasons if r)) or "no reason given"
        lines.append(
            f"BROKER BLOCKED: it blocks publishing ({why}) for {', '.join(s.blocked_publishers)}"
        )
    if pubs:
        lines.append(plain_table(["publisher", "host", "pid", "heartbeat", "state"], pubs))
    return "\n".join(lines)


def _publisher_rows(s: OutboxStats) -> list[tuple[str, str, int, str, str]]:
    """The publishers table's rows: id, host, pid, heartbeat age, state."""
    return [
        (
            p.publisher_id,
            p.hostname,
            p.pid,
            duration(_ago(p.heartbeat_at, s.at)) + " ago",
            ("blocked" if p.blocked else "alive")
            if p.alive
            else ("stopped" if p.stopped_at else "silent"),
        )
        for p in s.publishers
    ]


def _next_delayed(s: OutboxStats) -> str:
    if not s.delayed or s.next_delayed_at is None:
        return ""
    return f", next due in {duration((s.next_delayed_at - s.at).total_seconds())}"


def show_stats(s: OutboxStats) -> None:
    """:func:`render_stats` for a terminal: tables and coloured states."""
    lat = s.confirm_latency
    say(f"outbox at {cell(s.at)} UTC", level="bold")
    show_table(
        ["status", "rows"],
        [*((st.value, n) for st, n in s.counts.items()), ("total", sum(s.counts.values()))],
    )
    show_table(
        ["figure", "value"],
        [
            ("oldest pending", duration(s.oldest_pending_age_seconds)),
            ("oldest unconfirmed", duration(s.oldest_in_flight_age_seconds)),
            (
                "confirm latency",
                f"p50 {duration(lat.p50)}, p90 {duration(lat.p90)}, "
                f"p99 {duration(lat.p99)} ({lat.samples} confirms, last "
                f"{duration(lat.window_seconds)})",
            ),
            ("possible duplicates", f"{s.possible_duplicates}{STREAMS_APART}"),
            ("operator republished", str(s.operator_republished)),
            (
                "parked (uncommitted Spark batches)",
                str(s.parked)
                + (f", oldest {duration(s.oldest_parked_age_seconds)}" if s.parked else ""),
            ),
            ("delayed (not due yet)", str(s.delayed) + _next_delayed(s)),
            *(upkeep_lines(s.upkeep, s.at) if s.upkeep is not None else []),
        ],
    )
    if s.blocked_publishers:
        say(f"BROKER BLOCKED for {', '.join(s.blocked_publishers)}", level="CRITICAL")
    pubs = _publisher_rows(s)
    alive = f"publishers: {s.publishers_alive} alive of {len(s.publishers)} known"
    show_table(["publisher", "host", "pid", "heartbeat", "state"], pubs, title=alive)


def upkeep_lines(u: Upkeep, now: dt.datetime) -> list[tuple[str, str]]:
    """The outbox table's upkeep as (figure, value) lines, its warnings and notes last."""
    vacuumed = (
        f"vacuumed {duration(_ago(u.last_vacuum_at, now))} ago"
        if u.last_vacuum_at is not None
        else "never vacuumed"
    )
    own = ", ".join(f"{k.removeprefix('autovacuum_')}={v}" for k, v in u.table_settings.items())
    said = advice(u, now=now)
    return [
        (
            "outbox table",
            f"{_mb(u.table_bytes + u.index_bytes)} ({_mb(u.table_bytes)} + "
            f"{_mb(u.index_bytes)} indexes), {u.live_rows:,} live rows, {u.dead_rows:,} dead",
        ),
        (
            "autovacuum",
            f"{'on' if u.server_autovacuum else 'OFF'}, naptime {u.naptime_seconds:g} s; "
            f"{vacuumed}{' (running now)' if u.vacuum_running else ''}, "
            f"{u.autovacuum_runs} autovacuums; the outbox's own: {own or 'none'}",
        ),
        *(("WARNING", w) for w in said.warnings),
        *(("note", n) for n in said.notes),
    ]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 10e6 else f"{n / 1e6:,.1f} MB"


def _ago(then: dt.datetime, now: dt.datetime) -> float:
    return max(0.0, (now - then).total_seconds())


#: "rejected": rows the Spark writer refused (bad values, id conflicts: `outbox rejects`)
def reject_line(r: WriterReject) -> str:
    """A row the Spark writer refused, on one line: when, batch, message id, reason."""
    when = f"{r.created_at:%Y-%m-%d %H:%M:%S}"
    return f"{when}  {r.batch_id:<24} {r.message_id or '-':<20} {r.reason}"


def audit_line(e: AuditEntry) -> str:
    """An operator action on one line: when, id, action, rows, who (as whom, from where), filter."""
    who = e.actor if e.principal in (None, e.actor) else f"{e.actor} (as {e.principal})"
    where = f" from {e.client_addr}" if e.client_addr else ""
    return (
        f"{e.at:%Y-%m-%d %H:%M:%S}  #{e.id:<5} {e.action:<10} {e.count:>6} rows  "
        f"{who}{where}  {json_compact(e.filter)}"
    )


BATCH_HEADERS = ["batch", "rows", *(s.value for s in Status), "dup", "rejected", "last confirmed"]


def batch_row(b: BatchSummary) -> tuple[Any, ...]:
    rejected = "-" if b.rejected_count is None else b.rejected_count
    return (
        b.batch_id,
        b.rows,
        *(b.counts[s] for s in Status),
        b.republished,
        rejected,
        b.last_confirmed_at,
    )


def render_batches(items: Sequence[BatchSummary]) -> str:
    rows = [batch_row(b) for b in items]
    return plain_table(BATCH_HEADERS, rows) if rows else "no batches"


def render_republish(r: Any, *, flt: RepublishFilter, request_id: str | None) -> str:
    what = flt.describe()
    if r.dry_run:
        head = f"dry run: would republish {r.count} of {r.matched} matching rows ({what})"
    elif r.replayed:
        head = (
            f"request id {request_id} was already used: it republished {r.count} rows "
            f"(audit {r.audit_id}); nothing moved now"
        )
    else:
        head = (
            f"republished {r.count} of {r.matched} matching rows ({what}); "
            f"audit {r.audit_id}, request id {request_id}"
        )
    sample = ", ".join(r.sample) if r.sample else "-"
    return f"{head}\nsample: {sample}"


OUTSTANDING_HEADERS = [
    "message",
    "publisher",
    "channel/lane",
    "tag/id",
    "attempt",
    "exchange/stream",
    "routing key",
    "age",
]


def outstanding_row(o: OutstandingConfirm) -> tuple[Any, ...]:
    """An in-flight row: its channel and delivery tag, or a stream's lane and publishing id."""
    if o.stream is not None:
        where: tuple[Any, ...] = (f"lane {o.lane}", f"id {o.stream_seq}", f"stream {o.stream}", "")
    else:
        tag = o.delivery_tag if o.delivery_tag is not None else "not sent"
        where = (o.channel_id, tag, o.exchange, o.routing_key)
    attempt = f"{o.attempt}/{o.max_attempts}"
    return (o.message_id, o.publisher, *where[:2], attempt, *where[2:], duration(o.age_seconds))


LANE_HEADERS = ["stream", "lane", "holder", "lease", "next id", "in flight", "takeovers"]


def lane_row(lane: StreamLane, now: dt.datetime) -> tuple[Any, ...]:
    if lane.owner is None:
        lease = "free"
    elif lane.held:
        lease = f"for {duration(_ago(now, lane.lease_until or now))}"
    else:
        lease = "expired: the next publisher to look takes it over"
    return (
        lane.stream,
        f"{lane.lane}/{lane.lanes}",
        lane.owner or "-",
        lease,
        lane.next_seq,
        lane.in_flight,
        lane.takeovers,
    )


def failure_place(g: FailureGroup) -> tuple[str, str]:
    """Where a failure group's rows went: its exchange and routing key, or its stream."""
    return (f"stream {g.stream}", "") if g.stream is not None else (g.exchange, g.routing_key)


def delivery_line(m: MessageRecord) -> str:
    """How often the broker may hold the message, in words."""
    if m.stream is not None:
        resent = f" ({m.lost_confirms} resend(s) under the same id)" if m.lost_confirms else ""
        why = "exactly once: the broker drops a repeated id"
        return f"guarantee        {m.destination}, {why}{resent}"
    dups = f", {m.lost_confirms} possible duplicate(s)" if m.lost_confirms else ""
    return f"guarantee        {m.destination}, at least once{dups}"
