"""Commands that change rows, audited: republish, parked keys and skip, purge."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from app.cli.common import (
    EXIT_OK,
    EXIT_PARTIAL,
    MAX_REPUBLISH_LIMIT,
    Failure,
    Sub,
    UsageError,
    actor_flag,
    bounded_float,
    bounded_int,
    database,
    json_flag,
    metrics_flags,
    one_line,
    positive_days,
    print_json,
    stream_name,
    timestamp,
)
from app.cli.render import render_republish
from app.cli_output import fancy, progress, show_table
from app.outbox.actions import (
    MAX_REASON,
    CannotSkip,
    OperatorActions,
    RequestIdReused,
)
from app.outbox.read.batches import batch_exists
from app.outbox.read.keys import ParkedKey, parked_keys
from app.outbox.retention import Retention
from app.outbox.scope import RepublishFilter, ScopeError
from app.outbox.states import TERMINAL_FAILURES
from app.settings import Settings


def _cmd_republish(settings: Settings, args: argparse.Namespace) -> int:
    flt = _republish_filter(args)
    request_id = None if args.dry_run else (args.request_id or f"cli-{uuid.uuid4()}")
    with database(settings) as engine:
        if flt.batch_id is not None and not batch_exists(engine, batch_id=flt.batch_id):
            raise Failure(f"no batch {flt.batch_id!r}")
        actions = OperatorActions(engine)
        try:
            result = actions.republish(
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
                result = actions.republish(
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
    with database(settings) as engine:
        items = parked_keys(engine, limit=args.limit, after=args.after)
    if args.json:
        from app.api.models import ParkedKeyOut

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


def _print_parked(items: Sequence[ParkedKey]) -> None:
    print(f"{'ordering key':<24} {'blocked by':<28} {'status':<9} {'waiting':>7}  reason")
    for k in items:
        reason = (k.blocking_error or "")[:60]
        print(
            f"{k.ordering_key[:24]:<24} {k.blocking_message_id[:28]:<28} "
            f"{k.blocking_status.value:<9} {k.waiting:>7}  {reason}"
        )


def _cmd_skip(settings: Settings, args: argparse.Namespace) -> int:
    with database(settings) as engine:
        try:
            result = OperatorActions(engine).skip(
                actor=args.actor, message_id=args.message_id, reason=args.reason
            )
        except CannotSkip as exc:
            raise Failure(str(exc)) from None
    if args.json:
        print_json(
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


def _cmd_move_lane(settings: Settings, args: argparse.Namespace) -> int:
    from app.streams.store import StreamStore

    with database(settings) as engine:
        done = StreamStore(engine).move(stream=args.stream, lane=args.lane, actor=args.actor)
    if args.json:
        print_json(done)
        return EXIT_OK
    if not done["freed"]:
        print(f"no lane of stream {args.stream!r} was held; audit {done['audit_id']}")
        return EXIT_OK
    held = ", ".join(f"lane {f['lane']} (held by {f['owner']})" for f in done["freed"])
    print(
        f"freed {held} of stream {args.stream!r}: the next publisher takes over from the "
        f"broker's last stored id; audit {done['audit_id']}"
    )
    return EXIT_OK


def _cmd_purge(settings: Settings, args: argparse.Namespace) -> int:
    from app.consumer import purge_inbox

    days = settings.retention_days if args.older_than_days is None else args.older_than_days
    inbox_days = settings.inbox_retention_days
    if args.every is not None:
        return _purge_every(settings, args, days, inbox_days)
    if args.metrics_port is not None:
        raise UsageError("--metrics-port serves a running purge: give --every too")
    with database(settings) as engine:
        retention = Retention(engine)
        if args.dry_run:
            return _purge_dry_run(retention, days, as_json=args.json)
        live = fancy(sys.stderr) and not args.json
        total = retention.count_purgeable(older_than=dt.timedelta(days=days)) if live else None
        coef = settings.purge_sleep_coef if args.sleep_coef is None else args.sleep_coef
        began = time.monotonic()
        with progress("purge", total) as bar:
            deleted = retention.purge_confirmed(
                older_than=dt.timedelta(days=days),
                chunk=args.chunk,
                on_chunk=bar.advance,
                sleep_coef=coef,
            )
        seconds = time.monotonic() - began
        forgotten = purge_inbox(engine, older_than=dt.timedelta(days=inbox_days), chunk=args.chunk)
        audit_id = retention.record_purge(
            actor=args.actor,
            older_than=dt.timedelta(days=days),
            deleted=deleted,
            inbox_deleted=forgotten,
            sleep_coef=coef,
            seconds=seconds,
        )
    done = {
        "dry_run": False,
        "older_than_days": days,
        "deleted": deleted,
        "seconds": round(seconds, 3),
        "sleep_coef": coef,
        "inbox_older_than_days": inbox_days,
        "inbox_deleted": forgotten,
        "audit_id": audit_id,
    }
    _print_purge(done, as_json=args.json)
    return EXIT_OK


def _purge_every(
    settings: Settings, args: argparse.Namespace, days: float, inbox_days: float
) -> int:
    """``--every``: a pass every so many seconds until SIGTERM or SIGINT; a line (or a JSON
    line) per audit row, a failed pass on stderr."""
    from app.consumer import purge_inbox
    from app.outbox.purging import PurgeLoop, PurgeSchedule

    schedule = PurgeSchedule(
        older_than=dt.timedelta(days=days),
        inbox_older_than=dt.timedelta(days=inbox_days),
        every=args.every,
        audit_every=args.audit_every,
        chunk=args.chunk,
        sleep_coef=settings.purge_sleep_coef if args.sleep_coef is None else args.sleep_coef,
        actor=args.actor,
    )

    def audited(done: dict[str, Any]) -> None:
        if args.json:
            print_json({"older_than_days": days, "every_s": args.every, **done})
        else:
            print(
                f"deleted {done['deleted']} confirmed rows confirmed more than {days:g} days "
                f"ago and {done['inbox_deleted']} consumer inbox rows, in {done['passes']} "
                f"passes ({done['failed_passes']} failed); audit {done['audit_id']}"
            )
        sys.stdout.flush()

    def failed(why: str) -> None:
        print(f"outbox purge: a pass failed, the next in {args.every:g} s: {why}", file=sys.stderr)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with database(settings) as engine:
        loop = PurgeLoop(
            Retention(engine),
            schedule,
            inbox=lambda older, chunk: purge_inbox(engine, older_than=older, chunk=chunk),
            on_audit=audited,
            on_failure=failed,
        )
        with _probes(loop, args):
            total = loop.run(stop)
    if not args.json:
        print(
            f"stopped after {total.passes} passes: {total.deleted} confirmed rows and "
            f"{total.inbox_deleted} inbox rows deleted"
        )
    return EXIT_OK


@contextlib.contextmanager
def _probes(loop: Any, args: argparse.Namespace) -> Iterator[None]:
    """``--metrics-port``: the loop's /metrics, /healthz and /readyz while it runs."""
    if args.metrics_port is None:
        yield
        return
    from app.cli.purgeprobes import ProbesThread, purge_probes

    probes = ProbesThread(purge_probes(loop, host=args.metrics_host, port=args.metrics_port))
    try:
        url = probes.start()
    except OSError as exc:
        raise UsageError(f"--metrics-port {args.metrics_port}: {exc.strerror or exc}") from None
    print(f"outbox purge: metrics on {url}/metrics", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        probes.close()


def _purge_dry_run(retention: Retention, days: float, *, as_json: bool) -> int:
    would = retention.count_purgeable(older_than=dt.timedelta(days=days))
    if as_json:
        print_json({"dry_run": True, "older_than_days": days, "would_delete": would})
        return EXIT_OK
    print(
        f"would delete {would} confirmed rows confirmed more than {days:g} days ago "
        "(dry run: nothing deleted)"
    )
    return EXIT_OK


def _print_purge(done: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print_json(done)
        return
    coef, days, inbox_days = (
        done["sleep_coef"],
        done["older_than_days"],
        done["inbox_older_than_days"],
    )
    paced = f", paced at --sleep-coef {coef:g}" if coef > 0 else ""
    print(
        f"deleted {done['deleted']} confirmed rows confirmed more than {days:g} days ago "
        f"in {done['seconds']:.1f} s{paced}"
    )
    print(
        f"deleted {done['inbox_deleted']} consumer inbox rows older than {inbox_days:g} days "
        "(OUTBOX_INBOX_RETENTION_DAYS)"
    )


def _republish_filter(args: argparse.Namespace) -> RepublishFilter:
    """The filter's own rules (:meth:`RepublishFilter.of`), as the API and the console apply."""
    try:
        return RepublishFilter.of(
            statuses=args.status or None,
            batch_id=args.batch,
            exchange=args.exchange,
            routing_key=args.routing_key,
            stream=args.stream,
            ordering_key=args.ordering_key,
            reason=args.reason,
            created_after=args.created_after,
            created_before=args.created_before,
        )
    except ScopeError as exc:
        raise UsageError(str(exc)) from None


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
    rep.add_argument("--stream", type=stream_name, help="only rows for this RabbitMQ stream")
    rep.add_argument("--reason", help="only rows whose error or reply text holds this, any case")
    rep.add_argument(
        "--ordering-key", help="only rows of this ordering key (a parked key's blocking row)"
    )
    rep.add_argument("--created-after", type=timestamp, help="ISO time, inclusive; naive = UTC")
    rep.add_argument("--created-before", type=timestamp, help="ISO time, exclusive; naive = UTC")
    rep.add_argument(
        "--limit",
        type=bounded_int(1, MAX_REPUBLISH_LIMIT),
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
    actor_flag(rep)
    json_flag(rep, "POST /v1/republish")
    rep.set_defaults(func=_cmd_republish)


def _add_keys(sub: Sub) -> None:
    park = sub.add_parser("parked", help="ordering keys parked behind a returned/nacked/failed row")
    park.add_argument("--limit", type=bounded_int(1, 1000), default=100)
    park.add_argument("--after", help="the last key of the previous page")
    json_flag(park, "GET /v1/keys/parked")
    park.set_defaults(func=_cmd_parked)
    skip = sub.add_parser(
        "skip",
        help="skip a terminal failure (audited): not delivered, its ordering key goes on",
    )
    skip.add_argument("message_id", help="the blocking row (see `outbox parked`)")
    skip.add_argument(
        "--reason", required=True, type=one_line(MAX_REASON), help="why (kept in the audit trail)"
    )
    actor_flag(skip)
    json_flag(skip, "POST .../skip")
    skip.set_defaults(func=_cmd_skip)


def _add_move_lane(sub: Sub) -> None:
    move = sub.add_parser(
        "move-lane",
        help="free a stream's lanes (audited): another publisher takes them over, exactly once",
    )
    move.add_argument("stream", type=stream_name, help="the stream (see `outbox streams`)")
    move.add_argument("--lane", type=bounded_int(0, 63), help="one lane (default: all)")
    actor_flag(move)
    json_flag(move)
    move.set_defaults(func=_cmd_move_lane)


def _add_purge(sub: Sub) -> None:
    pur = sub.add_parser(
        "purge",
        help="delete confirmed rows past the retention period (bounded chunks)",
        description="Delete confirmed rows confirmed longer ago than the retention period, "
        "a bounded chunk per transaction so publishers never wait on it. Run it periodically, "
        "or keep it running with --every.",
    )
    pur.add_argument(
        "--older-than-days",
        type=positive_days,
        default=None,
        help="retention in days (default OUTBOX_RETENTION_DAYS)",
    )
    pur.add_argument(
        "--chunk", type=bounded_int(1, 100_000), default=1000, help="rows per transaction"
    )
    pur.add_argument(
        "--sleep-coef",
        type=bounded_float(0, 100),
        default=None,
        help="after each chunk, sleep this many times as long as it took (default "
        "OUTBOX_PURGE_SLEEP_COEF, 0: no pause; 1: at most half the database's time, twice "
        "as long)",
    )
    once = pur.add_mutually_exclusive_group()
    once.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    once.add_argument(
        "--every",
        type=bounded_float(0.1, 86_400),
        default=None,
        metavar="SECONDS",
        help="keep running: a pass every SECONDS until SIGTERM, so each deletes a few seconds "
        "of rows rather than a cron interval's at once (say 5)",
    )
    pur.add_argument(
        "--audit-every",
        type=bounded_float(1, 86_400),
        default=3600.0,
        metavar="SECONDS",
        help="with --every: one audit row per SECONDS for the passes that deleted rows, and "
        "one at the stop (default 3600)",
    )
    metrics_flags(pur, when="with --every: ")
    actor_flag(pur, "who purges")
    json_flag(pur, what="what was (or would be) deleted, as JSON")
    pur.set_defaults(func=_cmd_purge)


def register(sub: Sub) -> None:
    """This group's commands (acting, audited: republish, keys (parked, skip), purge,
    move-lane)."""
    _add_republish(sub)
    _add_keys(sub)
    _add_purge(sub)
    _add_move_lane(sub)
