"""The `outbox` command line: one entry point for operators and scripts.

Exit codes: 0 done; 1 operational failure (database unreachable, schema missing, unknown batch);
2 usage error or bad configuration; 3 republish left matching rows behind its --limit.
`status --check` exits 0 OK, 1 WARNING, 2 CRITICAL.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import ipaddress
import math
import os
import re
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, ProgrammingError

from app.cli_output import cell, fancy, plain_table, progress, say, show_table
from app.db import SchemaMismatch, check_schema, head_revision, make_engine, migrate
from app.logs import configure as configure_logging
from app.logs import redact
from app.outbox import queries
from app.outbox.repository import (
    MAX_ACTOR,
    MAX_REASON,
    CannotSkip,
    OutboxRepository,
    RepositoryError,
    RequestIdReused,
    has_control_characters,
    utcnow,
)
from app.outbox.scope import RepublishFilter, ScopeError
from app.outbox.states import TERMINAL_FAILURES, Status
from app.settings import Settings

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
#: republish moved some of the matching rows and left the rest (its --limit)
EXIT_PARTIAL = 3
MAX_REPUBLISH_LIMIT = 100_000


class UsageError(Exception):
    """The command line or the configuration is wrong (exit code 2)."""


class Failure(Exception):
    """The command could not do its job (exit code 1)."""


# -------------------------------------------------------------------------- rendering


_cell = cell


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


def render_stats(s: queries.OutboxStats) -> str:
    lat = s.confirm_latency
    counts = [(status.value, n) for status, n in s.counts.items()]
    pubs = [
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
    lines = [
        f"outbox at {_cell(s.at)} UTC",
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
        f"possible duplicates   {s.possible_duplicates}",
        f"operator republished  {s.operator_republished}",
        f"parked (uncommitted)  {s.parked}"
        + (f", oldest {duration(s.oldest_parked_age_seconds)}" if s.parked else ""),
        f"delayed (not due yet) {s.delayed}" + _next_delayed(s),
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


def _next_delayed(s: queries.OutboxStats) -> str:
    if not s.delayed or s.next_delayed_at is None:
        return ""
    return f", next due in {duration((s.next_delayed_at - s.at).total_seconds())}"


def show_stats(s: queries.OutboxStats) -> None:
    """:func:`render_stats` for a terminal: tables and coloured states."""
    lat = s.confirm_latency
    say(f"outbox at {_cell(s.at)} UTC", level="bold")
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
            ("possible duplicates", str(s.possible_duplicates)),
            ("operator republished", str(s.operator_republished)),
            (
                "parked (uncommitted Spark batches)",
                str(s.parked)
                + (f", oldest {duration(s.oldest_parked_age_seconds)}" if s.parked else ""),
            ),
            ("delayed (not due yet)", str(s.delayed) + _next_delayed(s)),
        ],
    )
    if s.blocked_publishers:
        say(f"BROKER BLOCKED for {', '.join(s.blocked_publishers)}", level="CRITICAL")
    pubs = [
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
    alive = f"publishers: {s.publishers_alive} alive of {len(s.publishers)} known"
    show_table(["publisher", "host", "pid", "heartbeat", "state"], pubs, title=alive)


def _ago(then: dt.datetime, now: dt.datetime) -> float:
    return max(0.0, (now - then).total_seconds())


#: "rejected": rows the Spark writer refused (bad values, id conflicts: `outbox rejects`)
BATCH_HEADERS = ["batch", "rows", *(s.value for s in Status), "dup", "rejected", "last confirmed"]


def _batch_row(b: queries.BatchSummary) -> tuple[Any, ...]:
    rejected = "-" if b.rejected_count is None else b.rejected_count
    return (
        b.batch_id,
        b.rows,
        *(b.counts[s] for s in Status),
        b.republished,
        rejected,
        b.last_confirmed_at,
    )


def render_batches(items: Sequence[queries.BatchSummary]) -> str:
    rows = [_batch_row(b) for b in items]
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


# --------------------------------------------------------------------------- commands


def _engine(settings: Settings) -> Engine:
    return make_engine(settings.database_url.get_secret_value())


def _cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    migrate(settings.database_url.get_secret_value(), args.revision)
    if args.json:
        _json({"revision": args.revision, "head": head_revision()})
        return EXIT_OK
    print(f"outbox schema at revision {args.revision}")
    return EXIT_OK


def _cmd_publish(settings: Settings, args: argparse.Namespace) -> int:
    from app.publisher.service import main as run_publisher_main  # lazy: the CLI imports without it

    try:
        rc = run_publisher_main(settings)
    except SchemaMismatch as exc:
        raise Failure(str(exc)) from None
    except RepositoryError as exc:  # e.g. another publisher holds this SQLite outbox
        raise Failure(str(exc)) from None
    return rc if isinstance(rc, int) else EXIT_OK


def _cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from app.api import ApiConfigError, create_app

    host = args.host or settings.api_host
    port = args.port or settings.api_port
    if args.insecure or settings.api_insecure:  # one rule, whichever way it is switched on
        if not _loopback(host):
            raise UsageError(
                f"insecure mode (--insecure / OUTBOX_API_INSECURE) serves on loopback addresses "
                f"only, not {host}"
            )
        settings = settings.model_copy(update={"api_insecure": True})
        print("outbox: serving WITHOUT authentication (insecure local mode)", file=sys.stderr)
    cert = args.tls_cert or settings.api_tls_cert
    key = args.tls_key or settings.api_tls_key
    if (cert is None) != (key is None):
        raise UsageError("TLS needs both --tls-cert and --tls-key (OUTBOX_API_TLS_CERT/_KEY)")
    for what, path in (("certificate", cert), ("key", key)):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"TLS {what} {path} is not a readable file")
    if cert is None and not _loopback(host):
        print(
            f"outbox: serving plain HTTP on {host}: bearer tokens cross the network in clear; "
            "use --tls-cert/--tls-key or a TLS-terminating proxy (docs/security.md)",
            file=sys.stderr,
        )
    try:
        app = create_app(settings)
    except ApiConfigError as exc:
        raise UsageError(str(exc)) from None
    # explicit: uvicorn's default trusts X-Forwarded-For from 127.0.0.1 (any local process,
    # or a forged header through a local proxy, would choose the audited and throttled address)
    proxies = args.forwarded_allow_ips or settings.api_forwarded_allow_ips or ""
    # log_config=None: uvicorn's access and error lines go to our handler (text or JSON, redacted)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        ssl_certfile=cert,
        ssl_keyfile=key,
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies,
        log_config=None,
    )
    return EXIT_OK


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    try:
        stats = queries.read_stats(
            engine,
            now=utcnow(),
            alive_after=3 * settings.publisher_heartbeat_interval,
            latency_window=dt.timedelta(seconds=settings.stats_latency_window),
            latency_rows=settings.stats_latency_rows,
        )
    finally:
        engine.dispose()
    from app.outbox.health import Thresholds, verdict

    limits = Thresholds(
        warn_pending_age=args.warn_pending_age,
        crit_pending_age=args.crit_pending_age,
        warn_in_flight_age=args.warn_in_flight_age,
        crit_in_flight_age=args.crit_in_flight_age,
    )
    found = verdict(stats, limits)
    if args.check:  # monitoring: one line, exit 0 OK / 1 WARNING / 2 CRITICAL
        print(found.line())
        return int(found.level)
    if args.json:
        from app.api.models import StatsOut

        print(StatsOut.of(stats).model_dump_json(indent=2))
    elif fancy():
        show_stats(stats)
        say(f"verdict: {found.line()}", level=found.level.name)
    else:
        print(render_stats(stats))
        print(f"verdict: {found.line()}")
    return EXIT_OK


def _cmd_message(settings: Settings, args: argparse.Namespace) -> int:
    from app.api.models import MessageOut

    engine = _engine(settings)
    try:
        found = queries.message(engine, message_id=args.message_id, include_body=args.body)
    finally:
        engine.dispose()
    if found is None:
        raise Failure(f"no message {args.message_id!r}")
    out = MessageOut.of(found)
    if args.json:
        print(out.model_dump_json(indent=2))
        return EXIT_OK
    for name, value in out.model_dump().items():
        if value not in (None, {}, []):
            print(f"{name:<16} {value}")
    return EXIT_OK


def _cmd_outstanding(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    flt = queries.OutstandingFilter(
        publisher=args.publisher,
        exchange=args.exchange,
        batch_id=args.batch,
        min_age_seconds=args.min_age,
    )
    try:
        after = queries.OutstandingKey.decode(args.cursor) if args.cursor else None
        page = queries.outstanding_confirms(
            engine, now=utcnow(), flt=flt, limit=args.limit, after=after
        )
    except queries.BadCursor as exc:
        raise UsageError(f"--cursor: {exc}") from None
    finally:
        engine.dispose()
    if args.json:
        from app.api.models import OutstandingOut, OutstandingPage

        out = OutstandingPage(
            items=[OutstandingOut.of(o) for o in page.items], next_cursor=page.next_cursor
        )
        print(out.model_dump_json(indent=2))
        return EXIT_OK
    if not page.items:
        print("nothing awaits a broker confirm")
        return EXIT_OK
    show_table(
        ["message", "publisher", "channel", "tag", "attempt", "exchange", "routing key", "age"],
        [
            (
                o.message_id,
                o.publisher,
                o.channel_id,
                o.delivery_tag if o.delivery_tag is not None else "not sent",
                f"{o.attempt}/{o.max_attempts}",
                o.exchange,
                o.routing_key,
                duration(o.age_seconds),
            )
            for o in page.items
        ],
    )
    if page.next_cursor:
        print(f"more: outbox outstanding --cursor {page.next_cursor}")
    return EXIT_OK


def _cmd_failures(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    try:
        groups = queries.failures_by_cause(engine, limit=args.limit)
    finally:
        engine.dispose()
    if args.json:
        from app.api.operators import FailureGroupOut, FailuresOut

        out = FailuresOut(
            groups=[
                FailureGroupOut(
                    status=g.status.value,
                    exchange=g.exchange,
                    routing_key=g.routing_key,
                    reason=g.reason,
                    rows=g.rows,
                    first_created=g.first_created,
                    last_created=g.last_created,
                    sample_message_id=g.sample_message_id,
                )
                for g in groups
            ],
            rows=sum(g.rows for g in groups),
        )
        print(out.model_dump_json(indent=2))
        return EXIT_OK
    if not groups:
        print("no returned, nacked or failed rows")
        return EXIT_OK
    if fancy():
        show_table(
            ["rows", "status", "exchange", "routing key", "reason", "sample"],
            [
                (
                    g.rows,
                    g.status.value,
                    g.exchange,
                    g.routing_key,
                    g.reason[:70],
                    g.sample_message_id,
                )
                for g in groups
            ],
        )
        say(
            "a message: outbox message ID; fix the cause, then outbox republish --status ... "
            "--exchange ..."
        )
        return EXIT_OK
    print(f"{'rows':>6}  {'status':<9} {'exchange':<20} {'routing key':<20} reason")
    for g in groups:
        print(
            f"{g.rows:>6}  {g.status.value:<9} {g.exchange[:20]:<20} {g.routing_key[:20]:<20} "
            f"{g.reason[:70]}"
        )
    print(
        "a message: outbox message ID; fix the cause, then outbox republish --status ... "
        "--exchange ..."
    )
    return EXIT_OK


def _cmd_rejects(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    try:
        found = queries.writer_rejects(engine, batch_id=args.batch, limit=args.limit)
    finally:
        engine.dispose()
    if args.json:
        import dataclasses
        import json

        print(json.dumps([dataclasses.asdict(r) for r in found], indent=2, default=str))
        return EXIT_OK
    if not found:
        print(
            "no rows refused by the Spark writer"
            + (f" in batch {args.batch}" if args.batch else "")
        )
        return EXIT_OK
    if fancy():
        show_table(
            ["at", "batch", "message id", "reason", "row"],
            [(r.created_at, r.batch_id, r.message_id, r.reason, r.row_json[:60]) for r in found],
        )
        return EXIT_OK
    for r in found:
        print(
            f"{r.created_at:%Y-%m-%d %H:%M:%S}  {r.batch_id:<24} {r.message_id or '-':<20} "
            f"{r.reason}"
        )
    return EXIT_OK


def _cmd_audit(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    try:
        entries = queries.audit_trail(engine, limit=args.limit)
    finally:
        engine.dispose()
    if args.json:
        import dataclasses
        import json

        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=2, default=str))
        return EXIT_OK
    if not entries:
        print("no operator actions recorded")
        return EXIT_OK
    if fancy():
        show_table(
            ["at", "#", "action", "rows", "actor", "verified as", "from", "filter"],
            [
                (
                    e.at,
                    e.id,
                    e.action,
                    e.count,
                    e.actor,
                    e.principal,
                    e.client_addr,
                    json_compact(e.filter),
                )
                for e in entries
            ],
        )
        return EXIT_OK
    for e in entries:
        who = e.actor if e.principal in (None, e.actor) else f"{e.actor} (as {e.principal})"
        where = f" from {e.client_addr}" if e.client_addr else ""
        print(
            f"{e.at:%Y-%m-%d %H:%M:%S}  #{e.id:<5} {e.action:<10} {e.count:>6} rows  "
            f"{who}{where}  {json_compact(e.filter)}"
        )
    return EXIT_OK


def _json(value: object) -> None:
    import json

    print(json.dumps(value, indent=2, default=str))


def json_compact(value: object) -> str:
    import json

    return json.dumps(value, separators=(",", ":"), default=str)[:120]


def _cmd_batches(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    try:
        if args.batch_id is not None:
            one = queries.batch_summary(engine, batch_id=args.batch_id)
            if one is None:
                raise Failure(f"no batch {args.batch_id!r}")
            items = [one]
        else:
            status = Status(args.status) if args.status else None
            items = queries.list_batches(engine, limit=args.limit, status=status).items
    finally:
        engine.dispose()
    if args.json:
        from app.api.models import BatchOut

        print("[" + ",\n".join(BatchOut.of(b).model_dump_json(indent=2) for b in items) + "]")
    elif fancy() and items:
        show_table(BATCH_HEADERS, [_batch_row(b) for b in items])
    else:
        print(render_batches(items))
    return EXIT_OK


def _cmd_republish(settings: Settings, args: argparse.Namespace) -> int:
    flt = _republish_filter(args)
    request_id = None if args.dry_run else (args.request_id or f"cli-{uuid.uuid4()}")
    engine = _engine(settings)
    try:
        if flt.batch_id is not None and not queries.batch_exists(engine, batch_id=flt.batch_id):
            raise Failure(f"no batch {flt.batch_id!r}")
        repo = OutboxRepository(engine)
        try:
            result = repo.republish(
                actor=args.actor,
                filter=flt,
                limit=args.limit,
                dry_run=args.dry_run,
                request_id=request_id,
            )
        except RequestIdReused as exc:
            raise UsageError(str(exc)) from None
        moved, chunk = result.count, 1
        chunked = args.all and not args.dry_run and not result.replayed
        with progress("republish", result.matched if chunked else None) as bar:
            bar.advance(result.count)
            while chunked and result.count == args.limit:
                chunk += 1  # every chunk its own audited request id, derived from the first
                result = repo.republish(
                    actor=args.actor,
                    filter=flt,
                    limit=args.limit,
                    dry_run=False,
                    request_id=f"{request_id}#{chunk}",
                )
                moved += result.count
                bar.advance(result.count)
                if not fancy(sys.stderr):
                    print(
                        f"chunk {chunk}: republished {result.count} (total {moved})",
                        file=sys.stderr,
                    )
    finally:
        engine.dispose()
    if args.json:
        from app.api.models import RepublishOut

        out = RepublishOut.of(result, request_id=request_id or "", flt=flt)
        print(out.model_dump_json(indent=2))
    else:
        print(render_republish(result, flt=flt, request_id=request_id))
        if chunk > 1:
            print(f"in all: {moved} rows republished in {chunk} chunks of at most {args.limit}")
    left = result.matched - result.count
    if not args.dry_run and not result.replayed and left > 0:
        print(
            f"outbox: {left} matching rows were left behind by --limit {args.limit}: run again "
            "with --all (chunks of --limit, each audited) or a higher --limit",
            file=sys.stderr,
        )
        return EXIT_PARTIAL
    return EXIT_OK


def _cmd_parked(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    try:
        items = queries.parked_keys(engine, limit=args.limit, after=args.after)
    finally:
        engine.dispose()
    if args.json:
        from app.api.keys import ParkedKeyOut

        print("[" + ",\n".join(ParkedKeyOut.of(k).model_dump_json(indent=2) for k in items) + "]")
        return EXIT_OK
    if not items:
        print("no parked keys")
        return EXIT_OK
    if fancy():
        show_table(
            ["ordering key", "blocked by", "status", "waiting", "reason"],
            [
                (
                    k.ordering_key,
                    k.blocking_message_id,
                    k.blocking_status.value,
                    k.waiting,
                    (k.blocking_error or "")[:60],
                )
                for k in items
            ],
        )
    else:
        _print_parked(items)
    print("resume: outbox republish --ordering-key KEY")
    print("release: outbox skip MESSAGE_ID --reason WHY")
    return EXIT_OK


def _print_parked(items: Sequence[queries.ParkedKey]) -> None:
    print(f"{'ordering key':<24} {'blocked by':<28} {'status':<9} {'waiting':>7}  reason")
    for k in items:
        reason = (k.blocking_error or "")[:60]
        print(
            f"{k.ordering_key[:24]:<24} {k.blocking_message_id[:28]:<28} "
            f"{k.blocking_status.value:<9} {k.waiting:>7}  {reason}"
        )


def _cmd_skip(settings: Settings, args: argparse.Namespace) -> int:
    engine = _engine(settings)
    try:
        result = OutboxRepository(engine).skip(
            actor=args.actor, message_id=args.message_id, reason=args.reason
        )
    except CannotSkip as exc:
        raise Failure(str(exc)) from None
    finally:
        engine.dispose()
    if args.json:
        _json(
            {
                "message_id": result.message_id,
                "previous": result.previous.value,
                "ordering_key": result.ordering_key,
                "released": result.released,
                "audit_id": result.audit_id,
            }
        )
        return EXIT_OK
    print(
        f"skipped {result.message_id} (was {result.previous.value}); key "
        f"{result.ordering_key!r}: {result.released} waiting rows released; audit "
        f"{result.audit_id}"
    )
    return EXIT_OK


def _cmd_purge(settings: Settings, args: argparse.Namespace) -> int:
    from app.consumer import purge_inbox

    days = settings.retention_days if args.older_than_days is None else args.older_than_days
    inbox_days = settings.inbox_retention_days
    engine = _engine(settings)
    repo = OutboxRepository(engine)
    try:
        if args.dry_run:
            would = repo.count_purgeable(older_than=dt.timedelta(days=days))
            if args.json:
                _json({"dry_run": True, "older_than_days": days, "would_delete": would})
                return EXIT_OK
            print(
                f"would delete {would} confirmed rows confirmed more than {days:g} days ago "
                "(dry run: nothing deleted)"
            )
            return EXIT_OK
        live = fancy(sys.stderr) and not args.json
        total = repo.count_purgeable(older_than=dt.timedelta(days=days)) if live else None
        with progress("purge", total) as bar:
            deleted = repo.purge_confirmed(
                older_than=dt.timedelta(days=days), chunk=args.chunk, on_chunk=bar.advance
            )
        forgotten = purge_inbox(engine, older_than=dt.timedelta(days=inbox_days), chunk=args.chunk)
        audit_id = repo.record_purge(
            actor=args.actor,
            older_than=dt.timedelta(days=days),
            deleted=deleted,
            inbox_deleted=forgotten,
        )
    finally:
        engine.dispose()
    if args.json:
        _json(
            {
                "dry_run": False,
                "older_than_days": days,
                "deleted": deleted,
                "inbox_older_than_days": inbox_days,
                "inbox_deleted": forgotten,
                "audit_id": audit_id,
            }
        )
        return EXIT_OK
    print(f"deleted {deleted} confirmed rows confirmed more than {days:g} days ago")
    print(
        f"deleted {forgotten} consumer inbox rows older than {inbox_days:g} days "
        "(OUTBOX_INBOX_RETENTION_DAYS)"
    )
    return EXIT_OK


def _cmd_consume(settings: Settings, args: argparse.Namespace) -> int:
    """Run the consumer kit on QUEUE with the handler MODULE:FUNCTION until SIGTERM/SIGINT."""
    import asyncio
    import importlib
    import signal

    from app.consumer import Consumer, ConsumerConfig, consumer_engine

    module_name, _, attr = args.handler.partition(":")
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"cannot load handler {args.handler!r}: {exc}") from None
    if not callable(handler):
        raise UsageError(f"handler {args.handler!r} is not callable")
    config = ConsumerConfig(
        name=args.name or args.queue,
        queue=args.queue,
        mode=args.mode or settings.consumer_mode,
        prefetch=args.prefetch or settings.consumer_prefetch,
        concurrency=args.concurrency or settings.consumer_concurrency,
        batch_size=args.batch_size or settings.consumer_batch_size,
        delivery_limit=args.delivery_limit or settings.consumer_delivery_limit,
        handler_timeout=args.handler_timeout or settings.consumer_handler_timeout,
        dead_letter_exchange=args.dead_letter_exchange,
        dead_letter_routing_key=args.dead_letter_routing_key,
    )
    engine = consumer_engine(
        settings.database_url.get_secret_value(), concurrency=config.concurrency
    )
    check_schema(engine)

    async def consume() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        given = {"batch_handler" if args.batches else "handler": handler}
        consumer = Consumer(
            config=config, amqp_url=settings.amqp_url.get_secret_value(), engine=engine, **given
        )
        probes = None
        if args.metrics_port is not None:  # /metrics, /healthz, /readyz of this process
            from app.consumer import registry_for
            from app.probes import ProbeServer, check_route, metrics_route

            def alive() -> tuple[bool, dict[str, object]]:
                return True, {"consumer": config.name}

            probes = ProbeServer(
                {
                    "/metrics": metrics_route(registry_for(consumer.metrics, consumer=config.name)),
                    "/healthz": check_route(alive),
                    "/readyz": check_route(consumer.ready),
                },
                host=args.metrics_host,
                port=args.metrics_port,
            )
            await probes.start()
            print(f"outbox consume: metrics on {probes.url}/metrics", file=sys.stderr)
        try:
            await consumer.run(stop)
        finally:
            if probes is not None:
                await probes.close()

    try:
        asyncio.run(consume())
    finally:
        engine.dispose()
    return EXIT_OK


def _cmd_declare(settings: Settings, args: argparse.Namespace) -> int:
    import asyncio

    from app.amqp.errors import ChannelClosedError, WireError
    from app.topology import declare, queue_arguments

    if args.bind and args.queue is None:
        raise UsageError("--bind needs --queue (the queue to bind)")
    try:
        queue_arguments(args.queue_type, delivery_limit=args.delivery_limit)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        url = settings.amqp_url.get_secret_value()
        done = asyncio.run(
            declare(
                url,
                exchange=args.exchange,
                kind=args.type,
                queue=args.queue,
                bindings=args.bind or (),
                queue_type=args.queue_type,
                delivery_limit=args.delivery_limit,
            )
        )
    except ChannelClosedError as exc:
        raise Failure(f"the broker refused: {exc.reason}") from None
    except (WireError, TimeoutError) as exc:
        raise Failure(f"broker: {redact(str(exc)) or type(exc).__name__}") from None
    if args.json:
        import dataclasses

        _json(dataclasses.asdict(done))
        return EXIT_OK
    print(f"exchange {done.exchange!r} ({done.kind}, durable) is declared")
    if done.queue is not None:
        keys = ", ".join(repr(k) for k in done.bindings)
        limit = f", delivery limit {done.delivery_limit}" if done.delivery_limit else ""
        print(
            f"queue {done.queue!r} ({done.queue_type}, durable{limit}) is bound to it with "
            f"{keys}; it holds {done.queue_messages} messages"
        )
    return EXIT_OK


def _cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from app.demo import main as demo_main  # lazy: Spark is an optional extra

    return demo_main(settings, rows=args.rows, files=args.files, workdir=args.workdir)


def _republish_filter(args: argparse.Namespace) -> RepublishFilter:
    """The filter's own rules (:meth:`RepublishFilter.of`), as the API and the console apply."""
    try:
        return RepublishFilter.of(
            statuses=args.status or None,
            batch_id=args.batch,
            exchange=args.exchange,
            routing_key=args.routing_key,
            ordering_key=args.ordering_key,
            reason=args.reason,
            created_after=args.created_after,
            created_before=args.created_before,
        )
    except ScopeError as exc:
        raise UsageError(str(exc)) from None


# ----------------------------------------------------------------------------- parser


def _timestamp(text: str) -> dt.datetime:
    try:
        stamp = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return stamp.replace(tzinfo=dt.UTC) if stamp.tzinfo is None else stamp.astimezone(dt.UTC)


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be within {low}..{high}, got {value}")
        return value

    return parse


def _positive_days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if not math.isfinite(days) or days <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number of days, got {text!r} (a purge never deletes "
            "rows confirmed just now)"
        )
    return days


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds: {text!r}")
    return value


def _line(most: int) -> Callable[[str], str]:
    """A text kept in the audit trail: one line of 1 to ``most`` characters, no control
    characters (they would forge lines in logs and tables), as the API checks it."""

    def check(text: str) -> str:
        value = text.strip()
        if not value or len(value) > most:
            raise argparse.ArgumentTypeError(f"must be 1 to {most} characters, got {len(value)}")
        if has_control_characters(value):
            raise argparse.ArgumentTypeError("must be one line, without control characters")
        return value

    return check


def _default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"[:MAX_ACTOR]


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (and exit code 2), with where to look for help."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="outbox",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Settings come from OUTBOX_* environment variables (see the README).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_migrate(sub)
    _add_publish(sub)
    _add_serve(sub)
    _add_status(sub)
    _add_batches(sub)
    _add_republish(sub)
    _add_keys(sub)
    _add_purge(sub)
    _add_consume(sub)
    _add_declare(sub)
    _add_demo(sub)
    return parser


Sub = Any  # argparse's _SubParsersAction is private


def _add_migrate(sub: Sub) -> None:
    mig = sub.add_parser("migrate", help="create or upgrade the outbox schema")
    mig.add_argument("--revision", default="head", help="target alembic revision (default head)")
    mig.add_argument("--json", action="store_true", help="the revision reached, as JSON")
    mig.set_defaults(func=_cmd_migrate)


def _add_publish(sub: Sub) -> None:
    pub = sub.add_parser(
        "publish",
        help="run a publisher: outbox rows to RabbitMQ with publisher confirms",
        description="Run a publisher until SIGINT/SIGTERM, then settle and stop.",
    )
    pub.set_defaults(func=_cmd_publish)


def _add_serve(sub: Sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve the REST API (uvicorn)",
        description="Serve the operator REST API. Needs OUTBOX_API_TOKEN and/or "
        "OUTBOX_OPERATOR_TOKEN, or --insecure on a loopback address.",
    )
    srv.add_argument("--host", help="address to bind (default OUTBOX_API_HOST, 127.0.0.1)")
    srv.add_argument(
        "--port", type=_bounded_int(1, 65535), help="port (default OUTBOX_API_PORT, 8080)"
    )
    srv.add_argument(
        "--insecure", action="store_true", help="allow serving without tokens (loopback only)"
    )
    srv.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    srv.add_argument("--tls-key", help="the certificate's private key (PEM)")
    srv.add_argument(
        "--forwarded-allow-ips",
        metavar="ADDRESSES",
        help="trust X-Forwarded-For/-Proto from these proxies only (comma-separated IPs or "
        "networks; default OUTBOX_API_FORWARDED_ALLOW_IPS, none)",
    )
    srv.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    srv.set_defaults(func=_cmd_serve)


def _add_status(sub: Sub) -> None:
    st = sub.add_parser("status", help="rows per status, oldest ages, confirm latency, publishers")
    st.add_argument("--json", action="store_true", help="the same as GET /v1/stats, as JSON")
    st.add_argument(
        "--check",
        action="store_true",
        help="one verdict line; exit 0 OK, 1 WARNING, 2 CRITICAL (for monitoring)",
    )
    for name, default in (
        ("warn-pending-age", 60.0),
        ("crit-pending-age", 300.0),
        ("warn-in-flight-age", 30.0),
        ("crit-in-flight-age", 120.0),
    ):
        st.add_argument(
            f"--{name}",
            type=_positive_seconds,
            default=default,
            metavar="SECONDS",
            help=f"threshold in seconds (default {default:g})",
        )
    st.set_defaults(func=_cmd_status)
    msg = sub.add_parser("message", help="one outbox row: status, attempts, reason, publish facts")
    msg.add_argument("message_id")
    msg.add_argument("--body", action="store_true", help="include the body (base64)")
    msg.add_argument("--json", action="store_true", help="as JSON (like GET /v1/messages/{id})")
    msg.set_defaults(func=_cmd_message)
    fail = sub.add_parser("failures", help="returned/nacked/failed rows grouped by cause")
    fail.add_argument("--limit", type=_bounded_int(1, 500), default=50, help="most groups shown")
    fail.add_argument("--json", action="store_true", help="as JSON (like GET /v1/failures)")
    fail.set_defaults(func=_cmd_failures)
    out = sub.add_parser(
        "outstanding", help="publishes awaiting a broker confirm: publisher, channel, tag, age"
    )
    out.add_argument("--publisher", help="only rows held by this publisher id")
    out.add_argument("--exchange", help="only rows for this exchange")
    out.add_argument("--batch", help="only rows of this batch id")
    out.add_argument(
        "--min-age",
        type=_positive_seconds,
        metavar="SECONDS",
        help="only rows waiting at least this long",
    )
    out.add_argument("--limit", type=_bounded_int(1, 1000), default=100, help="most rows shown")
    out.add_argument("--cursor", help="the `more:` cursor of the previous page")
    out.add_argument(
        "--json", action="store_true", help="as JSON (like GET /v1/confirms/outstanding)"
    )
    out.set_defaults(func=_cmd_outstanding)
    rej = sub.add_parser(
        "rejects",
        help="rows the Spark writer refused (reject mode): bad values and message id "
        "conflicts, with the reason, newest first",
    )
    rej.add_argument("--batch", help="only this batch id")
    rej.add_argument("--limit", type=_bounded_int(1, 500), default=50)
    rej.add_argument("--json", action="store_true", help="as JSON (like GET /v1/rejects)")
    rej.set_defaults(func=_cmd_rejects)
    aud = sub.add_parser("audit", help="operator actions (republish, skip), newest first")
    aud.add_argument("--limit", type=_bounded_int(1, 500), default=50)
    aud.add_argument("--json", action="store_true", help="as JSON")
    aud.set_defaults(func=_cmd_audit)


def _add_batches(sub: Sub) -> None:
    bat = sub.add_parser("batches", help="rows per status for each batch")
    bat.add_argument("batch_id", nargs="?", help="show this batch only")
    bat.add_argument(
        "--status", choices=[s.value for s in Status], help="only batches with rows in it"
    )
    bat.add_argument("--limit", type=_bounded_int(1, 500), default=50, help="most batches shown")
    bat.add_argument("--json", action="store_true", help="as JSON (like GET /v1/batches)")
    bat.set_defaults(func=_cmd_batches)


def _add_republish(sub: Sub) -> None:
    rep = sub.add_parser(
        "republish",
        help="move returned/nacked/failed rows back to pending (audited)",
        description="Move terminal-failure rows back to pending so the publisher sends them "
        "again. Every real run writes an audit row; repeating a --request-id replays its result "
        "and moves nothing.",
    )
    rep.add_argument("--batch", help="only this batch id")
    rep.add_argument(
        "--status",
        action="append",
        choices=sorted(s.value for s in TERMINAL_FAILURES),
        help="only rows in this status (repeatable; default all three)",
    )
    rep.add_argument("--exchange", help="only rows for this exchange")
    rep.add_argument("--routing-key", help="only rows with this routing key")
    rep.add_argument("--reason", help="only rows whose error or reply text holds this, any case")
    rep.add_argument(
        "--ordering-key", help="only rows of this ordering key (a parked key's blocking row)"
    )
    rep.add_argument("--created-after", type=_timestamp, help="ISO time, inclusive; naive = UTC")
    rep.add_argument("--created-before", type=_timestamp, help="ISO time, exclusive; naive = UTC")
    rep.add_argument(
        "--limit",
        type=_bounded_int(1, MAX_REPUBLISH_LIMIT),
        default=1000,
        help="most rows moved (default 1000)",
    )
    rep.add_argument("--dry-run", action="store_true", help="count and sample; move nothing")
    rep.add_argument(
        "--all",
        action="store_true",
        help="repeat in chunks of --limit until every matching row moved",
    )
    rep.add_argument("--request-id", help="idempotency key (default: a new one, printed)")
    rep.add_argument(
        "--actor", type=_line(MAX_ACTOR), default=_default_actor(), help="who acts (audit row)"
    )
    rep.add_argument("--json", action="store_true", help="as JSON (like POST /v1/republish)")
    rep.set_defaults(func=_cmd_republish)


def _add_keys(sub: Sub) -> None:
    park = sub.add_parser("parked", help="ordering keys parked behind a returned/nacked/failed row")
    park.add_argument("--limit", type=_bounded_int(1, 1000), default=100)
    park.add_argument("--after", help="the last key of the previous page")
    park.add_argument("--json", action="store_true", help="as JSON (like GET /v1/keys/parked)")
    park.set_defaults(func=_cmd_parked)
    skip = sub.add_parser(
        "skip",
        help="skip a terminal failure (audited): not delivered, its ordering key goes on",
    )
    skip.add_argument("message_id", help="the blocking row (see `outbox parked`)")
    skip.add_argument(
        "--reason", required=True, type=_line(MAX_REASON), help="why (kept in the audit trail)"
    )
    skip.add_argument(
        "--actor", type=_line(MAX_ACTOR), default=_default_actor(), help="who acts (audit row)"
    )
    skip.add_argument("--json", action="store_true", help="as JSON (like POST .../skip)")
    skip.set_defaults(func=_cmd_skip)


def _add_purge(sub: Sub) -> None:
    pur = sub.add_parser(
        "purge",
        help="delete confirmed rows past the retention period (bounded chunks)",
        description="Delete confirmed rows confirmed longer ago than the retention period, "
        "a bounded chunk per transaction so publishers never wait on it. Run it periodically.",
    )
    pur.add_argument(
        "--older-than-days",
        type=_positive_days,
        default=None,
        help="retention in days (default OUTBOX_RETENTION_DAYS)",
    )
    pur.add_argument(
        "--chunk", type=_bounded_int(1, 100_000), default=1000, help="rows per transaction"
    )
    pur.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    pur.add_argument(
        "--actor", type=_line(MAX_ACTOR), default=_default_actor(), help="who purges (audit row)"
    )
    pur.add_argument("--json", action="store_true", help="what was (or would be) deleted, as JSON")
    pur.set_defaults(func=_cmd_purge)


def _add_consume(sub: Sub) -> None:
    con = sub.add_parser(
        "consume",
        help="consume a queue with the idempotent consumer kit (manual acks, prefetch, inbox)",
        description="Each message's effect happens once: the handler runs in a database "
        "transaction with the inbox row, then the delivery is acknowledged; a redelivery or a "
        "duplicate publish is acknowledged without running it again.",
    )
    con.add_argument("queue", help="the queue to consume (it must exist)")
    con.add_argument(
        "--handler", required=True, help="MODULE:FUNCTION taking (message, connection)"
    )
    con.add_argument(
        "--batches",
        action="store_true",
        help="the handler takes (messages, connection): a window's messages at once",
    )
    con.add_argument("--name", help="consumer name, the inbox key (default: the queue)")
    con.add_argument(
        "--prefetch",
        type=_bounded_int(1, 65535),
        default=None,
        help="unacked deliveries held at once (default OUTBOX_CONSUMER_PREFETCH, 400)",
    )
    con.add_argument(
        "--mode",
        choices=("batch", "message"),
        default=None,
        help="batch: windows of deliveries per transaction (effects in the database); message: "
        "a transaction per message (effects outside it) (default OUTBOX_CONSUMER_MODE, batch)",
    )
    con.add_argument(
        "--concurrency",
        type=_bounded_int(1, 256),
        default=None,
        help="handler threads (default OUTBOX_CONSUMER_CONCURRENCY, 8)",
    )
    con.add_argument(
        "--batch-size",
        type=_bounded_int(1, 10000),
        default=None,
        help="batch mode: deliveries per transaction at most (default "
        "OUTBOX_CONSUMER_BATCH_SIZE, 200)",
    )
    con.add_argument(
        "--delivery-limit",
        type=_bounded_int(1, 1000),
        default=None,
        help="attempts (failures, timeouts, crashes) before a message is "
        "dead-lettered (default OUTBOX_CONSUMER_DELIVERY_LIMIT, 5)",
    )
    con.add_argument(
        "--handler-timeout",
        type=_positive_seconds,
        default=None,
        help="seconds a handler may run before its attempt fails (default "
        "OUTBOX_CONSUMER_HANDLER_TIMEOUT, 60)",
    )
    con.add_argument(
        "--dead-letter-exchange",
        default=None,
        help="publish dead letters here with headers saying why ('' is the default exchange), "
        "then ack them; without it they are rejected (the queue's x-dead-letter-exchange)",
    )
    con.add_argument(
        "--dead-letter-routing-key",
        default=None,
        help="routing key for --dead-letter-exchange (default: the message's)",
    )
    con.add_argument(
        "--metrics-port",
        type=_bounded_int(0, 65535),
        default=None,
        help="serve /metrics, /healthz, /readyz on this port (0: any free one)",
    )
    con.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")
    con.set_defaults(func=_cmd_consume)


def _add_declare(sub: Sub) -> None:
    dec = sub.add_parser(
        "declare",
        help="declare the exchange rows go to (and a queue bound to it): durable, idempotent",
        description="Declare EXCHANGE, durable, on OUTBOX_AMQP_URL's broker; with --queue also "
        "a durable queue bound to it. Rows for an exchange that does not exist end 'failed' "
        "(404 NOT_FOUND) once their retries are spent. Declaring what exists with the same "
        "type changes nothing.",
    )
    dec.add_argument("exchange")
    dec.add_argument(
        "--type",
        default="topic",
        choices=["direct", "topic", "fanout", "headers"],
        help="exchange type (default topic)",
    )
    dec.add_argument("--queue", help="also declare this queue and bind it")
    dec.add_argument(
        "--queue-type",
        default="classic",
        choices=["classic", "quorum"],
        help="classic (default; one node) or quorum (replicated on a cluster: "
        "a confirm means a majority wrote it)",
    )
    dec.add_argument(
        "--delivery-limit",
        type=int,
        metavar="N",
        help="quorum only: x-delivery-limit, the broker dead-letters (or drops) a "
        "message after N returns",
    )
    dec.add_argument(
        "--bind",
        action="append",
        metavar="KEY",
        help="binding key, repeatable (default '#' for topic, '' else)",
    )
    dec.add_argument("--json", action="store_true", help="what was declared, as JSON")
    dec.set_defaults(func=_cmd_declare)


def _add_demo(sub: Sub) -> None:
    dem = sub.add_parser(
        "demo", help="the main job end to end: Spark -> outbox -> RabbitMQ, verified"
    )
    dem.add_argument("--rows", type=_bounded_int(1, 10_000_000), default=20_000)
    dem.add_argument("--files", type=_bounded_int(1, 1000), default=4, help="micro-batches")
    dem.add_argument("--workdir", type=Path, default=Path("demo-data"))
    dem.set_defaults(func=_cmd_demo)


# -------------------------------------------------------------------------------- main


def _config_problem(exc: ValidationError) -> str:
    """The fields and messages of a settings error, never the values (they may be secrets)."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]).upper()
        parts.append(f"OUTBOX_{field}: {err['msg']}")
    return "; ".join(parts)


def _db_problem(exc: DBAPIError, *, url: str) -> str:
    first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
    first = _without_password(first, url=url)
    if isinstance(exc, ProgrammingError) or "no such table" in first:
        return f"database schema missing or outdated ({first}): run `outbox migrate`"
    return f"database unavailable: {first}"


def _without_password(text: str, *, url: str) -> str:
    """``text`` without any piece of the URL's password. A password holding an unescaped ``@``
    is split by the URL parser, and the driver's error quotes its tail as a host name."""
    _, _, rest = url.partition("://")
    userinfo, at, _ = rest.rpartition("@")
    _, colon, password = userinfo.partition(":")
    if not (at and colon and password):
        return text
    for piece in sorted({password, *re.split(r"[:@]", password)}, key=len, reverse=True):
        if len(piece) >= 3:
            text = text.replace(piece, "***")
    if "@" in password:
        text += " (write an '@' in the database password as %40)"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    err = sys.stderr
    for arg in given:  # bytes that are not UTF-8 arrive as lone surrogates: no database takes them
        try:
            arg.encode()
        except UnicodeEncodeError:
            try:  # the bytes as given: 'a\xffb'
                raw = arg.encode(errors="surrogateescape")
            except UnicodeEncodeError:
                raw = arg.encode(errors="backslashreplace")
            shown = raw.decode(errors="backslashreplace")
            print(
                f"outbox: the argument '{shown}' is not valid UTF-8 (see `outbox --help`)", file=err
            )
            return EXIT_USAGE
    args = build_parser().parse_args(given)
    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"outbox: bad configuration: {_config_problem(exc)}", file=err)
        return EXIT_USAGE
    configure_logging(level=settings.log_level, fmt=settings.log_format)
    return _run(args, settings, err)


def _run(args: argparse.Namespace, settings: Settings, err: TextIO) -> int:
    try:
        return int(args.func(settings, args))
    except BrokenPipeError:  # `outbox status | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except UsageError as exc:
        print(f"outbox: {exc}", file=err)
        return EXIT_USAGE
    except Failure as exc:
        print(f"outbox: {exc}", file=err)
        return EXIT_FAILURE
    except DBAPIError as exc:
        print(f"outbox: {_db_problem(exc, url=settings.database_url.get_secret_value())}", file=err)
        return EXIT_FAILURE
    except (SchemaMismatch, OSError) as exc:
        print(f"outbox: {redact(str(exc))}", file=err)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
