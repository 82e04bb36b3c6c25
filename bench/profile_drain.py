"""Profile one publisher draining a seeded outbox: ``python -m bench.profile_drain``.

Seeds ``--rows`` rows (PostgreSQL by default, ``--backend sqlite``), runs ``python -m
app.publisher --until-empty`` under py-spy (``--mode py-spy``, sampled, all threads, native
frames off) or cProfile (``--mode cprofile``, main thread only), and prints where the time goes:
self time per function and the share of samples under each top-level task.

While it runs it also samples the CPU time of the publisher, PostgreSQL and RabbitMQ processes, so
the report says which process the drain waits on.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Services, seed_postgres, seed_sqlite, temp_postgres, temp_sqlite, topology
from bench.workloads.drain import REPO_ROOT, _confirmed

PY_SPY = Path(sys.executable).with_name("py-spy")


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def _pids_of(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class CpuSampler(threading.Thread):
    """CPU ticks used by processes matching each pattern while it runs (short-lived ones too:
    every pid is sampled every 0.2 s and its last sample counts)."""

    def __init__(self, patterns: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.patterns = patterns
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.owner: dict[int, str] = {}
        self.done = threading.Event()
        self._sample(initial=True)

    def _sample(self, *, initial: bool = False) -> None:
        for name, pattern in self.patterns.items():
            for pid in _pids_of(pattern):
                ticks = _cpu_ticks([pid])
                self.first.setdefault(pid, ticks if initial else 0)
                self.owner[pid] = name
                self.last[pid] = ticks

    def run(self) -> None:
        while not self.done.wait(0.2):
            self._sample()

    def seconds(self) -> dict[str, float]:
        self.done.set()
        hz = os.sysconf("SC_CLK_TCK")
        out = dict.fromkeys(self.patterns, 0.0)
        for pid, name in self.owner.items():
            out[name] += (self.last[pid] - self.first.get(pid, 0)) / hz
        return out


def _collapsed_report(path: Path, top: int) -> str:
    """Self and inclusive sample counts from py-spy's collapsed-stack output."""
    self_count: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        count = int(n)
        total += count
        frames = stack.split(";")
        self_count[_short(frames[-1])] += count
        for frame in {_short(f) for f in frames}:
            incl[frame] += count
    lines = [f"{total} samples", "", "self time (top):"]
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in self_count.most_common(top)]
    lines += ["", "inclusive time (top):"]
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in incl.most_common(top)]
    return "\n".join(lines)


def _threads_report(path: Path) -> str:
    """With ``--idle``: how busy the DB thread and the event loop were, and on what."""
    db: collections.Counter[str] = collections.Counter()
    loop: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if any(f.startswith("_worker (") for f in frames):
            repo = [f for f in frames if "repository.py" in f or f.startswith("open_rows (")]
            db[_short(repo[0]) if repo else "(waiting for work)"] += int(n)
        elif any(".run_forever (" in f for f in frames):
            idle = any("Selector.select (" in f for f in frames)
            mine = [f for f in frames if "/publisher/" in f or "confirms.py" in f]
            loop["(idle in select)" if idle else _short(mine[-1]) if mine else "(other)"] += int(n)
    out = []
    for name, counter in (("DB thread", db), ("event loop", loop)):
        total = sum(counter.values()) or 1
        out.append(f"{name} (share of its wall time):")
        out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in counter.most_common(12)]
    return "\n".join(out)


def _short(frame: str) -> str:
    # "func (path/to/module.py:123)" -> "func (module.py)"
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 2)
    return f"{name} ({'/'.join(file[-2:])})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--backend", choices=("postgresql", "sqlite"), default="postgresql")
    parser.add_argument(
        "--mode",
        choices=("py-spy", "cprofile", "none"),
        default="py-spy",
        help="none: no profiler, only the CPU seconds per process",
    )
    parser.add_argument("--idle", action="store_true", help="py-spy: include idle (wall) time")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None, help="keep the raw profile here")
    args = parser.parse_args()
    services = Services.from_env()
    make_db = temp_postgres(services) if args.backend == "postgresql" else temp_sqlite()
    seed = seed_postgres if args.backend == "postgresql" else seed_sqlite
    with (
        make_db as db_url,
        topology(services, "profile") as topo,
        tempfile.TemporaryDirectory(prefix="outbox-prof-") as tmp,
    ):
        seed(db_url, n=args.rows, exchange=topo.exchange, routing_key=topo.routing_key)
        raw = args.out or Path(tmp) / ("profile.txt" if args.mode == "py-spy" else "profile.pstats")
        target = [sys.executable, "-m", "app.publisher", "--until-empty"]
        if args.mode == "py-spy":
            cmd = [
                str(PY_SPY),
                "record",
                "--format",
                "raw",
                "--rate",
                "250",
                "--threads",
                "-o",
                str(raw),
                *(["--idle"] if args.idle else []),
                "--",
                *target,
            ]
        elif args.mode == "cprofile":
            cmd = [
                sys.executable,
                "-m",
                "cProfile",
                "-o",
                str(raw),
                "-m",
                "app.publisher",
                "--until-empty",
            ]
        else:
            cmd = target
        env = dict(os.environ, OUTBOX_DATABASE_URL=db_url, OUTBOX_AMQP_URL=services.amqp_url)
        sampler = CpuSampler({"postgres": "^postgres", "rabbitmq": "beam.smp"})
        sampler.start()
        start = dt.datetime.now(dt.UTC)
        t0 = time.monotonic()
        log = Path(tmp) / "publisher.log"
        with log.open("wb") as out:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        wall = time.monotonic() - t0
        usage = os.times()
        others = sampler.seconds()
        count, _, last = _confirmed(db_url)
        if proc.returncode != 0 or count != args.rows or last is None:
            print(log.read_text()[-3000:])
            print(f"profiled run failed: rc {proc.returncode}, {count} of {args.rows} confirmed")
            return 1
        seconds = (last - start).total_seconds()
        print(
            f"{args.rows:,} rows drained in {seconds:.2f}s ({args.rows / seconds:,.0f} rows/s, "
            f"slowed by the profiler); wall {wall:.1f}s"
        )
        mine = usage.children_user + usage.children_system
        print(
            f"CPU seconds: publisher (+profiler) {mine:.1f}"
            + "".join(f", {k} {v:.1f}" for k, v in others.items())
        )
        per_row = {"publisher": mine, **others}
        print(
            "CPU µs per row: "
            + ", ".join(f"{k} {1e6 * v / args.rows:.0f}" for k, v in per_row.items())
        )
        if args.mode == "py-spy":
            print(_collapsed_report(raw, args.top))
            if args.idle:
                print("\n" + _threads_report(raw))
        elif args.mode == "cprofile":
            import pstats

            stats = pstats.Stats(str(raw))
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
