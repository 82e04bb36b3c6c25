"""The fault matrix in lanes: ``python -m chaos.run --lanes 2`` (``make chaos``).

Most of a scenario's time is waiting (a broker restarting, a lease running out, a confirm timing
out), so two lanes run side by side on two cores, each a ``python -m chaos.run --lane K/N`` of its
own with a RabbitMQ and a PostgreSQL of its own (:meth:`PrivateServices.for_matrix` of the lane:
ports 5683 + 10 K and 5443 + 10 K). A server that only one matrix may run pins its scenarios to one
lane: the three-node cluster (``cluster``, and the network-namespace cluster of ``partition``) to
lane 0, the Patroni pair to lane 1. The rest go, longest expected first, to the lane with the
least expected time.

The parent streams each lane's output with its lane's prefix, then prints one table of every
scenario, and exits 1 if any lane lost a row, failed a check or could not start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO

from chaos.matrix import BY_KEY
from chaos.runner import Result, Scenario

#: Seconds each scenario took in a ``make chaos`` of 2026-11-30 in two lanes (10k rows, the
#: other lane running beside it); only the assignment depends on them, never a verdict. A
#: scenario missing here counts as :data:`DEFAULT_SECONDS`.
EXPECTED_SECONDS: dict[str, float] = {
    "5": 11,
    "7": 18,
    "9": 9,
    "11a": 9,
    "11d": 10,
    "12": 16,
    "16": 35,
    "15": 19,
    "15c": 22,
    "17a": 41,
    "17b": 41,
    "17c": 111,
    "17d": 57,
    "17e": 82,
    "17f": 41,
    "17g": 36,
    "20": 115,
    "21b": 20,
    "21c": 31,
    "1": 11,
    "2": 11,
    "3a": 13,
    "3b": 17,
    "3c": 125,
    "4": 10,
    "6": 18,
    "8": 18,
    "10": 9,
    "11b": 9,
    "11c": 8,
    "14": 39,
    "16b": 28,
    "15b": 29,
    "13": 70,
    "19a": 33,
    "19b": 33,
    "19c": 40,
}
DEFAULT_SECONDS = 30.0


def pinned_lane(scenario: Scenario, lanes: int) -> int | None:
    """The lane a scenario must run in, or None: servers with fixed ports run in one lane."""
    module = scenario.inject.__module__
    if scenario.cluster or module == "chaos.partition":
        return 0
    if module == "chaos.pg_failover":
        return 1 % lanes
    return None


def assign(keys: Sequence[str], lanes: int) -> list[list[str]]:
    """Each key in exactly one lane, the matrix's order kept within a lane."""
    out: list[list[str]] = [[] for _ in range(lanes)]
    load = [0.0] * lanes
    free = []
    for key in keys:
        lane = pinned_lane(BY_KEY[key], lanes)
        if lane is None:
            free.append(key)
        else:
            out[lane].append(key)
            load[lane] += EXPECTED_SECONDS.get(key, DEFAULT_SECONDS)
    for key in sorted(free, key=lambda k: -EXPECTED_SECONDS.get(k, DEFAULT_SECONDS)):
        lane = min(range(lanes), key=lambda i: load[i])
        out[lane].append(key)
        load[lane] += EXPECTED_SECONDS.get(key, DEFAULT_SECONDS)
    order = {k: i for i, k in enumerate(keys)}
    return [sorted(lane, key=order.__getitem__) for lane in out]


def _pump(prefix: str, stream: IO[str]) -> None:
    for line in iter(stream.readline, ""):
        print(f"{prefix}{line}", end="", flush=True)


def child_argv(
    lane: str, keys: Sequence[str], *, rows: int, repeat: int, keep_services: bool, out: Path
) -> list[str]:
    """One lane's ``chaos.run``: its scenarios, each run ``repeat`` times."""
    argv = [sys.executable, "-m", "chaos.run", "--lane", lane, "--only", ",".join(keys)]
    argv += ["--rows", str(rows), "--repeat", str(repeat), "--json", str(out)]
    return [*argv, "--keep-services"] if keep_services else argv


def run_lanes(
    keys: Sequence[str],
    lanes: int,
    *,
    rows: int,
    repeat: int,
    keep_services: bool,
    json_out: Path | None,
) -> tuple[int, list[Result]]:
    """Run the scenarios ``keys`` (each once in the list), ``repeat`` times each, in ``lanes``
    child processes; (exit code, every lane's results)."""
    with tempfile.TemporaryDirectory(prefix="chaos-lanes-") as workdir:
        return _run(keys, lanes, rows, repeat, keep_services, json_out, Path(workdir))


def _run(
    keys: Sequence[str],
    lanes: int,
    rows: int,
    repeat: int,
    keep_services: bool,
    json_out: Path | None,
    workdir: Path,
) -> tuple[int, list[Result]]:
    children = []
    for index, lane_keys in enumerate(assign(keys, lanes)):
        if not lane_keys:
            continue
        out = workdir / f"lane{index}.json"
        argv = child_argv(
            f"{index}/{lanes}",
            lane_keys,
            rows=rows,
            repeat=repeat,
            keep_services=keep_services,
            out=out,
        )
        print(f"lane {index}: {', '.join(lane_keys)}", flush=True)
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        pump = threading.Thread(target=_pump, args=(f"[{index}] ", proc.stdout))
        pump.start()
        children.append((index, proc, pump, out))
    codes = []
    results: list[Result] = []
    for index, proc, pump, out in children:
        codes.append(proc.wait())
        pump.join()
        if out.exists():
            results += [Result(**r) for r in json.loads(out.read_text())]
        else:
            print(f"lane {index} wrote no results (exit {proc.returncode})", flush=True)
    if json_out:
        json_out.write_text(out_json(results))
    return max(codes, default=0), results


def out_json(results: Sequence[Result]) -> str:
    return json.dumps([asdict(r) for r in results], indent=2, default=str)


def lane_of(text: str) -> tuple[int, int]:
    """``K/N`` → (K, N), with 0 ≤ K < N."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise SystemExit(f"--lane wants K/N (e.g. 1/2), not {text!r}") from None
    if not 0 <= k < n:
        raise SystemExit(f"--lane {text}: K must be in 0..N-1")
    return k, n


def wall(began: float) -> str:
    return f"{(time.monotonic() - began) / 60:.1f} min"
