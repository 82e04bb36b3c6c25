"""CPU time of the services a workload uses, from the processes' own counters (/proc).

A service is found by the TCP port it listens on (PostgreSQL's postmaster, RabbitMQ's Erlang VM);
its CPU is the process's user+system time plus that of its children, live (``/proc/<pid>/stat``)
and reaped (the parent's ``cutime``/``cstime``): PostgreSQL's backends are children of the
postmaster and come and go with connections.
"""

from __future__ import annotations

import os
from pathlib import Path

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
    """User+system CPU of ``pid``, its reaped children and its live children."""
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
    return total / TICKS


class ServiceCpu:
    """CPU seconds used by the services on ``ports`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, **ports: int) -> None:
        self.pids = {name: listening_pid(port) for name, port in ports.items()}
        self._start: dict[str, float] = {}

    def start(self) -> None:
        self._start = {n: tree_cpu_seconds(p) for n, p in self.pids.items() if p is not None}

    def stop(self) -> dict[str, float]:
        return {n: tree_cpu_seconds(p) - self._start[n]  # type: ignore[arg-type]
                for n, p in self.pids.items() if n in self._start}  # fmt: skip


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
