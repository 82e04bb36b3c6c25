"""``python -m chaos.run`` (``make chaos``): the fault matrix, one table, a non-zero exit on loss.

    python -m chaos.run                      all scenarios, 10k rows each
    python -m chaos.run --only 1,4,5 --rows 2000
    python -m chaos.run --skip 13 --keep-services
    python -m chaos.run --only 3b --rows 2000 --repeat 5      (hunting a flaky outcome)
    python -m chaos.run --long               the faults that last minutes (make chaos-long)
    python -m chaos.run --lanes 2            two lanes side by side (make chaos; chaos/lanes.py)

Starts a RabbitMQ and a PostgreSQL of its own (ports 5683 and 5443, data in .local/chaos; lane K
of ``--lanes`` 10 K ports up, data in .local/chaos-laneK), stops them at the end. Exit 1 if any
scenario lost a message, exceeded its duplicate bound, left a row in an unexpected state or failed
one of its checks; exit 2 if the services could not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from chaos import lanes, procs
from chaos.matrix import BY_KEY, SCENARIOS
from chaos.runner import MatrixEnv, Result, run_scenario
from chaos.services import PrivateServices, ServiceError

HEADER = (
    "scenario",
    "rows",
    "confirmed",
    "terminal by reason",
    "lost",
    "dups",
    "allowed",
    "product dups",
    "at fault",
    "recovery s",
    "stall s",
    "result",
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value).replace("|", "/")


def row_of(r: Result) -> tuple[str, ...]:
    terminal = "; ".join(f"{label}: {n}" for label, n in sorted(r.terminal.items())) or "-"
    verdict = "ok" if r.ok else "FAIL"
    return (
        f"{r.key} {r.title}",
        str(r.rows),
        str(r.confirmed),
        terminal,
        str(r.lost),
        str(r.duplicates),
        str(r.allowed),
        str(r.product_dups),
        r.at_fault or "-",
        _cell(r.recovery),
        _cell(r.stall),
        verdict,
    )


def table(results: Sequence[Result]) -> str:
    """A Markdown table: readable in a terminal, pasteable into docs/fault-matrix.md."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cell(c) for c in row_of(r)) + " |" for r in results]
    return "\n".join(lines)


def _select(only: str | None, skip: str | None, *, long: bool = False) -> list[str]:
    """The scenarios to run: the long ones with ``long`` (or when named by ``only``), the
    others without."""
    keys = [s.key for s in SCENARIOS if s.long == long]
    if only:
        keys = [s.key for s in SCENARIOS]
        wanted = [k.strip() for k in only.split(",") if k.strip()]
        unknown = [k for k in wanted if k not in BY_KEY]
        if unknown:
            raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(keys)}")
        keys = [k for k in keys if k in wanted]
    if skip:
        dropped = {k.strip() for k in skip.split(",")}
        keys = [k for k in keys if k not in dropped]
    return keys


async def run_matrix(env: MatrixEnv, keys: Sequence[str], *, rows: int) -> list[Result]:
    results = []
    for key in keys:
        scenario = BY_KEY[key]
        print(f"--- {key}: {scenario.title} ({rows} rows)", flush=True)
        result = await run_scenario(env, scenario, rows=rows)
        print(result.explain(), flush=True)
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chaos.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=10_000, help="rows per scenario")
    parser.add_argument("--only", help="comma-separated scenario keys (e.g. 1,3a,13)")
    parser.add_argument("--skip", help="comma-separated scenario keys to leave out")
    parser.add_argument(
        "--keep-services",
        action="store_true",
        help="leave the private RabbitMQ and PostgreSQL running",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="the scenarios whose faults last minutes (make chaos-long) instead of the others",
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the selection N times")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="run the selection in N lanes side by side, each on servers of its own (chaos.lanes)",
    )
    parser.add_argument("--lane", help=argparse.SUPPRESS)  # K/N: one lane's child (chaos.lanes)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)  # the verifier's expected disconnects
    logging.getLogger("rstream").setLevel(logging.ERROR)  # "leader not yet elected" (21c)
    selected = _select(args.only, args.skip, long=args.long)
    if args.lanes > 1 and not args.lane:
        return _in_lanes(selected, args)
    keys = selected * max(1, args.repeat)
    lane = lanes.lane_of(args.lane)[0] if args.lane else 0
    services = PrivateServices.for_matrix(lane=lane)
    began = time.monotonic()
    try:
        env = MatrixEnv.open(services)
    except ServiceError as exc:
        print(f"cannot start the private services: {exc}", file=sys.stderr)
        return 2
    try:
        print(
            f"private services: {services.amqp_url} and PostgreSQL on 127.0.0.1:"
            f"{services.pg_port}; logs in {env.log_dir}",
            flush=True,
        )
        results = asyncio.run(run_matrix(env, keys, rows=args.rows))
    finally:
        procs.kill_all()
        env.close(stop_services=not args.keep_services)
    minutes = (time.monotonic() - began) / 60
    print()
    print(table(results))
    print(f"\n{sum(r.ok for r in results)} of {len(results)} scenarios ok in {minutes:.1f} min")
    if args.json:
        args.json.write_text(lanes.out_json(results))
    return 0 if all(r.ok for r in results) else 1


def _in_lanes(keys: Sequence[str], args: argparse.Namespace) -> int:
    began = time.monotonic()
    repeat = max(1, args.repeat)
    code, results = lanes.run_lanes(
        keys,
        args.lanes,
        rows=args.rows,
        repeat=repeat,
        keep_services=args.keep_services,
        json_out=args.json,
    )
    print()
    print(table(results))
    ok, runs = sum(r.ok for r in results), len(keys) * repeat
    print(f"\n{ok} of {runs} scenarios ok in {lanes.wall(began)} ({args.lanes} lanes)")
    if code == 0 and ok != runs:
        code = 1  # a lane that reported fewer results than it was given
    return code


if __name__ == "__main__":
    sys.exit(main())
