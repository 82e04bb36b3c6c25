"""Render the last run as Markdown (for docs/performance.md): ``python -m bench.report``.

Reads ``bench/results/latest.json`` and ``latest-runs.json`` (or ``--stem partial``).
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.proccpu import cpu_by_process
from bench.run import (
    FLOOR_TARGETS,
    LATENCY_FLOOR_MS,
    LATENCY_KEYS_MS,
    PUBLISHER_CPU_LIMIT,
    PUBLISHER_CPU_RATIO,
    RESULTS,
    RSS_GROWTH_LIMIT_PCT,
    TARGETS,
)


def _fmt(value: float, unit: str) -> str:
    return f"{value:,.1f}" if unit in ("ms", "MB") else f"{value:,.0f}"


def render(numbers: dict[str, float], detail: dict[str, object]) -> str:
    workloads = detail["workloads"]
    assert isinstance(workloads, dict)
    out = [
        f"Run finished {detail['finished']} on {detail['cpus']} CPUs, `BENCH_SCALE` "
        f"{numbers.get('bench_scale')}, {detail['repeats']} runs per workload, "
        f"{numbers.get('bench_seconds', 0):.0f} s in all; load average (1, 5, 15 min) "
        f"{detail['load_before']} before, {detail['load_after']} after.",
        "",
        "| key | median | unit | runs |",
        "|---|---:|---|---|",
    ]
    for key, w in workloads.items():
        runs = ", ".join(_fmt(r, w["unit"]) for r in w["runs"])
        out.append(f"| `{key}` | {_fmt(w['median'], w['unit'])} | {w['unit']} | {runs} |")
    out += ["", "| target | ratio | goal | met |", "|---|---:|---:|---|"]
    for ratio, num, den, target in TARGETS:
        if ratio in numbers:
            met = "yes" if numbers[ratio] >= target else "**no**"
            out.append(f"| `{num}` / `{den}` | {numbers[ratio]:.2f} | ≥ {target} | {met} |")
    if "publisher_peak_rss_growth_pct" in numbers:
        growth = numbers["publisher_peak_rss_growth_pct"]
        met = "yes" if growth < RSS_GROWTH_LIMIT_PCT else "**no**"
        out.append(
            f"| publisher peak RSS, 4x backlog vs 1x "
            f"({numbers['publisher_peak_rss_mb']:.1f} → {numbers['publisher_peak_rss_mb_4x']:.1f}"
            f" MB) | {growth:+.1f} % | < {RSS_GROWTH_LIMIT_PCT:.0f} % | {met} |"
        )
    for key in LATENCY_KEYS_MS:
        if key in numbers:
            out.append(f"| `{key}` | {numbers[key]:.1f} ms | | |")
    for key in LATENCY_FLOOR_MS:
        if key in numbers:
            out.append(
                f"| `{key}`: the broker alone at that rate | {numbers[key]:.1f} ms | "
                "(the floor) | |"
            )
    for key, limit, label in FLOOR_TARGETS:
        if key in numbers:
            met = "yes" if numbers[key] <= limit else "**no**"
            out.append(f"| {label} | {numbers[key]:.2f} | ≤ {limit:g} | {met} |")
    for key in ("drain_postgres", "drain_postgres_2_publishers"):
        bound = numbers.get(f"{key}_cpu_bound_rows_per_s")
        if bound:
            out.append(
                f"| `{key}` / the rate its CPU per row allows on these cores ({bound:,.0f} "
                f"rows/s) | {numbers[f'ratio_{key}_vs_cpu_bound']:.2f} | (a report) | |"
            )
    if PUBLISHER_CPU_RATIO in numbers:
        cpu_ratio = float(numbers[PUBLISHER_CPU_RATIO])
        met = "yes" if cpu_ratio <= PUBLISHER_CPU_LIMIT else "**no**"
        out.append(
            f"| publisher CPU per row / aio-pika window CPU per message "
            f"({numbers['drain_postgres_cpu_us_per_row_publisher']:.0f} / "
            f"{numbers['publish_aio_pika_window_cpu_us_per_msg']:.0f} µs) | {cpu_ratio:.2f} | "
            f"≤ {PUBLISHER_CPU_LIMIT} | {met} |"
        )
    out += _cpu_table(workloads)
    failed = detail.get("failed") or {}
    assert isinstance(failed, dict)
    out += [f"\nFAILED {name}: {error}" for name, error in failed.items()]
    return "\n".join(out)


def _cpu_table(workloads: dict[str, dict[str, object]]) -> list[str]:
    """CPU microseconds per message (row) of each process involved, medians over the runs."""
    rows = []
    for key, w in workloads.items():
        by_process = cpu_by_process(w)
        if by_process:
            each = ", ".join(f"{name} {us:,.0f}" for name, us in by_process.items())
            rows.append(f"| `{key}` | {each} | {sum(by_process.values()):,.0f} |")
    if not rows:
        return []
    head = "| workload | CPU µs per message (row), per process (medians of the runs) | sum |"
    return ["", head, "|---|---|---:|", *rows]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stem", default="latest")
    args = parser.parse_args()
    numbers = json.loads((RESULTS / f"{args.stem}.json").read_text())
    detail = json.loads((RESULTS / f"{args.stem}-runs.json").read_text())
    print(render(numbers, detail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
