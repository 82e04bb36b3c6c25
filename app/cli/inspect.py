"""Commands that look: status, message, outstanding, streams, failures, rejects, audit,
batches."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from app.cli.common import (
    EXIT_OK,
    Failure,
    Sub,
    UsageError,
    bounded_int,
    database,
    json_compact,
    json_flag,
    positive_seconds,
    print_json,
    stream_name,
)
from app.cli.render import (
    BATCH_HEADERS,
    LANE_HEADERS,
    OUTSTANDING_HEADERS,
    audit_line,
    batch_row,
    delivery_line,
    failure_place,
    lane_row,
    outstanding_row,
    reject_line,
    render_batches,
    render_stats,
    show_stats,
)
from app.cli_output import fancy, say, show_table
from app.outbox.database import utcnow
from app.outbox.read.audit import audit_trail
from app.outbox.read.batches import batch_summary, list_batches
from app.outbox.read.cursors import BadCursor
from app.outbox.read.failures import failures_by_cause
from app.outbox.read.messages import message
from app.outbox.read.outstanding import (
    OutstandingFilter,
    OutstandingKey,
    list_lanes,
    outstanding_confirms,
)
from app.outbox.read.rejects import writer_rejects
from app.outbox.read.stats import stats_for
from app.outbox.states import Status
from app.settings import Settings


def _cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    with database(settings) as engine:
        stats = stats_for(engine, settings=settings, now=utcnow())
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

    with database(settings) as engine:
        found = message(engine, message_id=args.message_id, include_body=args.body)
    if found is None:
        raise Failure(f"no message {args.message_id!r}")
    out = MessageOut.of(found)
    if args.json:
        print(out.model_dump_json(indent=2))
        return EXIT_OK
    for name, value in out.model_dump().items():
        if value not in (None, {}, []):
            print(f"{name:<16} {value}")
    print(delivery_line(found))
    return EXIT_OK


def _cmd_outstanding(settings: Settings, args: argparse.Namespace) -> int:
    flt = OutstandingFilter(
        publisher=args.publisher,
        exchange=args.exchange,
        batch_id=args.batch,
        min_age_seconds=args.min_age,
        stream=args.stream,
    )
    try:
        after = OutstandingKey.decode(args.cursor) if args.cursor else None
    except BadCursor as exc:
        raise UsageError(f"--cursor: {exc}") from None
    with database(settings) as engine:
        page = outstanding_confirms(engine, now=utcnow(), flt=flt, limit=args.limit, after=after)
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
    show_table(OUTSTANDING_HEADERS, [outstanding_row(o) for o in page.items])
    if page.next_cursor:
        print(f"more: outbox outstanding --cursor {page.next_cursor}")
    return EXIT_OK


def _cmd_streams(settings: Settings, args: argparse.Namespace) -> int:
    with database(settings) as engine:
        now = utcnow()
        lanes = list_lanes(engine, now=now, stream=args.stream)
    if args.json:
        from app.api.models import StreamLaneOut

        print_json([StreamLaneOut.of(lane).model_dump(mode="json") for lane in lanes])
        return EXIT_OK
    if not lanes:
        print("no stream lanes: no row for a stream was published yet")
        return EXIT_OK
    show_table(LANE_HEADERS, [lane_row(lane, now) for lane in lanes])
    return EXIT_OK


def _cmd_failures(settings: Settings, args: argparse.Namespace) -> int:
    with database(settings) as engine:
        groups = failures_by_cause(engine, limit=args.limit)
    if args.json:
        from app.api.models import FailuresOut

        print(FailuresOut.of(groups).model_dump_json(indent=2))
        return EXIT_OK
    if not groups:
        print("no returned, nacked or failed rows")
        return EXIT_OK
    if fancy():
        show_table(
            ["rows", "status", "exchange/stream", "routing key", "reason", "sample"],
            [
                (
                    g.rows,
                    g.status.value,
                    *failure_place(g),
                    g.reason[:70],
                    g.sample_message_id,
                )
                for g in groups
            ],
        )
        say(
            "a message: outbox message ID; fix the cause, then outbox republish --status ... "
            "--exchange ... (or --stream ...)"
        )
        return EXIT_OK
    print(f"{'rows':>6}  {'status':<9} {'exchange/stream':<20} {'routing key':<20} reason")
    for g in groups:
        place, key = failure_place(g)
        print(f"{g.rows:>6}  {g.status.value:<9} {place[:20]:<20} {key[:20]:<20} {g.reason[:70]}")
    print(
        "a message: outbox message ID; fix the cause, then outbox republish --status ... "
        "--exchange ... (or --stream ...)"
    )
    return EXIT_OK


def _answered(records: Sequence[Any], *, as_json: bool, none: str) -> bool:
    """Print ``records`` (dataclasses) as JSON, or ``none`` when there are none: True when that
    was the whole answer, False when the records are still to be shown."""
    if as_json:
        print_json([dataclasses.asdict(r) for r in records])
    elif not records:
        print(none)
    return as_json or not records


def _cmd_rejects(settings: Settings, args: argparse.Namespace) -> int:
    with database(settings) as engine:
        found = writer_rejects(engine, batch_id=args.batch, limit=args.limit)
    none = "no rows refused by the Spark writer" + (f" in batch {args.batch}" if args.batch else "")
    if _answered(found, as_json=args.json, none=none):
        return EXIT_OK
    if fancy():
        show_table(
            ["at", "batch", "message id", "reason", "row"],
            [(r.created_at, r.batch_id, r.message_id, r.reason, r.row_json[:60]) for r in found],
        )
        return EXIT_OK
    for r in found:
        print(reject_line(r))
    return EXIT_OK


def _cmd_audit(settings: Settings, args: argparse.Namespace) -> int:
    with database(settings) as engine:
        entries = audit_trail(engine, limit=args.limit)
    if _answered(entries, as_json=args.json, none="no operator actions recorded"):
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
        print(audit_line(e))
    return EXIT_OK


def _cmd_batches(settings: Settings, args: argparse.Namespace) -> int:
    with database(settings) as engine:
        if args.batch_id is not None:
            one = batch_summary(engine, batch_id=args.batch_id)
            if one is None:
                raise Failure(f"no batch {args.batch_id!r}")
            items = [one]
        else:
            status = Status(args.status) if args.status else None
            items = list_batches(engine, limit=args.limit, status=status).items
    if args.json:
        from app.api.models import BatchOut

        print("[" + ",\n".join(BatchOut.of(b).model_dump_json(indent=2) for b in items) + "]")
    elif fancy() and items:
        show_table(BATCH_HEADERS, [batch_row(b) for b in items])
    else:
        print(render_batches(items))
    return EXIT_OK


def _add_status(sub: Sub) -> None:
    st = sub.add_parser("status", help="rows per status, oldest ages, confirm latency, publishers")
    json_flag(st, "GET /v1/stats")
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
            type=positive_seconds,
            default=default,
            metavar="SECONDS",
            help=f"threshold in seconds (default {default:g})",
        )
    st.set_defaults(func=_cmd_status)
    msg = sub.add_parser("message", help="one outbox row: status, attempts, reason, publish facts")
    msg.add_argument("message_id")
    msg.add_argument("--body", action="store_true", help="include the body (base64)")
    json_flag(msg, "GET /v1/messages/{id}")
    msg.set_defaults(func=_cmd_message)
    fail = sub.add_parser("failures", help="returned/nacked/failed rows grouped by cause")
    fail.add_argument("--limit", type=bounded_int(1, 500), default=50, help="most groups shown")
    json_flag(fail, "GET /v1/failures")
    fail.set_defaults(func=_cmd_failures)
    rej = sub.add_parser(
        "rejects",
        help="rows the Spark writer refused (reject mode): bad values and message id "
        "conflicts, with the reason, newest first",
    )
    rej.add_argument("--batch", help="only this batch id")
    rej.add_argument("--limit", type=bounded_int(1, 500), default=50)
    json_flag(rej, "GET /v1/rejects")
    rej.set_defaults(func=_cmd_rejects)
    aud = sub.add_parser("audit", help="operator actions (republish, skip), newest first")
    aud.add_argument("--limit", type=bounded_int(1, 500), default=50)
    json_flag(aud)
    aud.set_defaults(func=_cmd_audit)


def _add_outstanding(sub: Sub) -> None:
    out = sub.add_parser(
        "outstanding", help="publishes awaiting a broker confirm: publisher, channel, tag, age"
    )
    out.add_argument("--publisher", help="only rows held by this publisher id")
    out.add_argument("--exchange", help="only rows for this exchange")
    out.add_argument("--stream", type=stream_name, help="only rows for this RabbitMQ stream")
    out.add_argument("--batch", help="only rows of this batch id")
    out.add_argument(
        "--min-age",
        type=positive_seconds,
        metavar="SECONDS",
        help="only rows waiting at least this long",
    )
    out.add_argument("--limit", type=bounded_int(1, 1000), default=100, help="most rows shown")
    out.add_argument("--cursor", help="the `more:` cursor of the previous page")
    json_flag(out, "GET /v1/confirms/outstanding")
    out.set_defaults(func=_cmd_outstanding)


def _add_streams(sub: Sub) -> None:
    lanes = sub.add_parser(
        "streams",
        help="the streams' lanes: holder, lease, next publishing id, takeovers, rows in flight",
    )
    lanes.add_argument("--stream", type=stream_name, help="only this stream's lanes")
    json_flag(lanes, "GET /v1/streams")
    lanes.set_defaults(func=_cmd_streams)


def _add_batches(sub: Sub) -> None:
    bat = sub.add_parser("batches", help="rows per status for each batch, newest first")
    bat.add_argument("batch_id", nargs="?", help="show this batch only")
    bat.add_argument(
        "--status", choices=[s.value for s in Status], help="only batches with rows in it"
    )
    bat.add_argument("--limit", type=bounded_int(1, 500), default=50, help="most batches shown")
    json_flag(bat, "GET /v1/batches")
    bat.set_defaults(func=_cmd_batches)


def register(sub: Sub) -> None:
    """This group's commands (reading: status, message, failures, outstanding, streams,
    rejects, audit, batches)."""
    _add_status(sub)
    _add_outstanding(sub)
    _add_streams(sub)
    _add_batches(sub)
