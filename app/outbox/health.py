"""A health verdict from the outbox's figures, for `outbox status --check` and monitoring.
Pure: stats and thresholds in, a level and its reasons out.

Exit codes follow the monitoring plugin convention: 0 OK, 1 WARNING, 2 CRITICAL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from app.outbox.read.stats import OutboxStats
from app.outbox.states import TERMINAL_FAILURES, Status
from app.outbox.upkeep import advice


class Level(IntEnum):
    OK = 0
    WARNING = 1
    CRITICAL = 2


@dataclass(frozen=True, slots=True)
class Thresholds:
    warn_pending_age: float = 60.0
    crit_pending_age: float = 300.0
    warn_in_flight_age: float = 30.0
    crit_in_flight_age: float = 120.0


@dataclass(frozen=True, slots=True)
class Verdict:
    level: Level
    reasons: list[str] = field(default_factory=list)

    def line(self) -> str:
        why = "; ".join(self.reasons) if self.reasons else "rows flow, publishers alive"
        return f"{self.level.name}: {why}"


def verdict(stats: OutboxStats, limits: Thresholds = Thresholds()) -> Verdict:
    crit: list[str] = []
    warn: list[str] = []
    open_rows = (
        stats.counts.get(Status.PENDING, 0)
        - stats.parked
        - stats.delayed
        + stats.counts.get(Status.IN_FLIGHT, 0)
    )
    if open_rows and stats.publishers_alive == 0:
        crit.append(f"{open_rows} rows waiting and no publisher alive")
    if stats.blocked_publishers:
        crit.append(
            f"the broker blocks {len(stats.blocked_publishers)} publisher(s) (resource alarm)"
        )
    _age(
        stats.oldest_pending_age_seconds,
        "oldest pending row",
        limits.warn_pending_age,
        limits.crit_pending_age,
        warn,
        crit,
    )
    _age(
        stats.oldest_in_flight_age_seconds,
        "oldest unconfirmed publish",
        limits.warn_in_flight_age,
        limits.crit_in_flight_age,
        warn,
        crit,
    )
    parked_age = stats.oldest_parked_age_seconds
    if stats.parked and parked_age is not None and parked_age > limits.warn_pending_age:
        warn.append(
            f"{stats.parked} rows parked by a Spark batch in fail mode that was "
            f"never recorded, oldest {parked_age:.0f}s (its driver died between the "
            "tasks and the commit?): re-run that batch to release them"
        )
    failures = sum(stats.counts.get(s, 0) for s in TERMINAL_FAILURES)
    if failures:
        warn.append(f"{failures} rows returned, nacked or failed (see `outbox failures`)")
    dead = len(stats.publishers) - stats.publishers_alive
    if dead and stats.publishers_alive:
        warn.append(f"{dead} known publisher(s) not alive")
    if stats.upkeep is not None:  # the table's notes are shown, not alarmed on
        warn.extend(advice(stats.upkeep, now=stats.at).warnings)
    if crit:
        return Verdict(Level.CRITICAL, crit + warn)
    return Verdict(Level.WARNING, warn) if warn else Verdict(Level.OK)


def _age(
    age: float | None, what: str, warn_at: float, crit_at: float, warn: list[str], crit: list[str]
) -> None:
    if age is None:
        return
    if age > crit_at:
        crit.append(f"{what} is {age:.0f}s old (critical above {crit_at:g}s)")
    elif age > warn_at:
        warn.append(f"{what} is {age:.0f}s old (warning above {warn_at:g}s)")
