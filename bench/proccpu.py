"""CPU time of the services a workload uses, from the processes' own counters (/proc).

A service is found by the TCP port it listens on (PostgreSQL's postmaster, RabbitMQ's Erlang VM);
its CPU is the process's user+system time plus that of its children, live (``/proc/<pid>/stat``)
and reaped (the parent's ``cutime``/``cstime``): PostgreSQL's backends are children of the
postmaster and come and go with connections.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from types import TracebackType
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from 3 (state) on


def _inodes_listening(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    return inodes


def listening_pid(port: int) -> int | None:
    """The process that listens on ``port`` (None if none is visible)."""
    inodes = _inodes_listening(port)
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(entry.name)
        except OSError:
            continue
    return None


def tree_cpu_seconds(pid: int) -> float:
    """User+system CPU of ``pid``, its reaped children and its live children.

    A child reaped while ``/proc`` is walked would count nowhere (gone from the walk, not yet
    in the parent's ``cutime`` as read before it): seen as PostgreSQL at 0.3 µs a row for a
    COPY whose two backends exited as the reading began. So the parent is read before and
    after the walk, and the walk is done again while a reaping came between."""
    for _ in range(20):
        own = _stat(pid)
        if own is None:
            return 0.0
        # fields (0-based from state): utime 11, stime 12, cutime 13, cstime 14
        total = sum(int(own[i]) for i in (11, 12, 13, 14))
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                st = _stat(int(entry.name))
                if st is not None and int(st[1]) == pid:  # ppid
                    total += int(st[11]) + int(st[12])
        after = _stat(pid)
        if after is None or after[13:15] == own[13:15]:
            break
    return total / TICKS


class ServiceCpu:
    """CPU seconds used by the services on ``ports`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, **ports: int) -> None:
        self.pids = {name: listening_pid(port) for name, port in ports.items()}
        self._start: dict[str, float] = {}

    def start(self) -> None:
        self._start = {n: tree_cpu_seconds(p) for n, p in self.pids.items() if p is not None}

    def stop(self) -> dict[str, float]:
        for pid in self.pids.values():
            if pid is not None:
                _wait_reaped(pid)
        return {
            n: tree_cpu_seconds(p) - self._start[n]  # type: ignore[arg-type]
            for n, p in self.pids.items()
            if n in self._start
        }


def _wait_reaped(pid: int, timeout: float = 2.0) -> None:
    """Wait (bounded) until ``pid`` has reaped its exited children. A zombie's ``stat`` shows no
    CPU, and its time joins the parent's ``cutime`` only once reaped: a PostgreSQL backend whose
    connection closed just before the reading would otherwise count for nothing (seen: 0 µs per
    message for a consumer that closed its pool as the run ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        zombies = False
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                st = _stat(int(entry.name))
                if st is not None and int(st[1]) == pid and st[0] == "Z":
                    zombies = True
                    break
        if not zombies:
            return
        time.sleep(0.01)


class RunCpu:
    """CPU seconds of one run: this process's (named ``own``) and the services' on ``ports``.

    ``with RunCpu("client", rabbitmq=5673) as cpu: ...`` then ``cpu.per_message(n)`` gives
    microseconds per message for each, e.g. ``{"client": 140.0, "rabbitmq": 55.0}``."""

    def __init__(self, own: str, **ports: int) -> None:
        self.own = own
        self.services = ServiceCpu(**ports)
        self.seconds: dict[str, float] = {}
        self._own_start = 0.0

    def __enter__(self) -> RunCpu:
        self.services.start()
        self._own_start = time.process_time()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        own = time.process_time() - self._own_start
        self.seconds = {self.own: own, **self.services.stop()}

    def per_message(self, n: int) -> dict[str, float]:
        return {name: seconds / n * 1e6 for name, seconds in self.seconds.items()}


def describe(per_message: dict[str, float]) -> str:
    """``client 140 us, rabbitmq 55 us`` (for the benchmark's progress lines)."""
    return ", ".join(f"{name} {us:.0f} us" for name, us in per_message.items())


def median_by_process(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of each process's figure over the runs (the processes of the first run), as
    ``statistics.median`` computes every other median of the benchmark (even counts average)."""
    return {name: statistics.median(r[name] for r in runs if name in r) for name in runs[0]}


def cpu_by_process(extra: dict[str, Any]) -> dict[str, float]:
    """A workload's median CPU microseconds per message (row) for each process, from the record
    it keeps (``cpu_us_per_row``: drains and Spark; ``cpu_us_per_msg_by_process``: the rest);
    empty when it keeps none."""
    for name in ("cpu_us_per_row", "cpu_us_per_msg_by_process"):
        runs = extra.get(name)
        if runs and isinstance(runs[0], dict):
            return median_by_process(runs)
    return {}


def subtree_cpu_seconds(pid: int) -> float:
    """User+system CPU of ``pid`` and of every live descendant (children's children too: Spark's
    JVM under the driver, its Python workers under the JVM), plus what each reaped."""
    parents: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                stats[int(entry.name)] = st
                parents.setdefault(int(st[1]), []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        st = stats.get(current)
        if st is not None:
            total += sum(int(st[i]) for i in (11, 12, 13, 14))
        todo += parents.get(current, [])
    return total / TICKS
