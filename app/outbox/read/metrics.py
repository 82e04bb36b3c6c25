"""The figures the API's ``/metrics`` exposes (:mod:`app.api.metrics`): what the database
knows, from the queries of :mod:`app.outbox.read.stats`, nothing more.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import Engine, select

from app.outbox.read.figures import age_seconds
from app.outbox.read.stats import (
    delayed_rows,
    oldest_ages,
    operator_republished,
    parked_rows,
    status_counts,
    table_upkeep,
)
from app.outbox.schema import publishers
from app.outbox.states import Status
from app.outbox.upkeep import Upkeep


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    counts: dict[Status, int]
    oldest_pending_age_seconds: float | None
    oldest_in_flight_age_seconds: float | None
    possible_duplicates: int
    operator_republished: int
    publishers_alive: int
    publishers_known: int
    parked: int = 0
    oldest_parked_age_seconds: float | None = None
    delayed: int = 0
    upkeep: Upkeep | None = None


def metrics_snapshot(engine: Engine, *, now: dt.datetime, alive_after: float) -> MetricsSnapshot:
    """The figures the API's ``/metrics`` exposes: what the database knows, nothing more."""
    with engine.connect() as conn:
        pending_age, in_flight_age = oldest_ages(conn, now=now)
        pubs = conn.execute(select(publishers.c.heartbeat_at, publishers.c.stopped_at)).all()
        alive = sum(
            1
            for beat, stopped in pubs
            if stopped is None and (age_seconds(beat, now) or 0.0) <= alive_after
        )
        counts, lost, _estimated = status_counts(conn)
        parked, parked_age = parked_rows(conn, now=now)
        delayed, _next = delayed_rows(conn, now=now)
        return MetricsSnapshot(
            counts=counts,
            oldest_pending_age_seconds=pending_age,
            oldest_in_flight_age_seconds=in_flight_age,
            possible_duplicates=lost,
            operator_republished=operator_republished(conn),
            publishers_alive=alive,
            publishers_known=len(pubs),
            parked=parked,
            oldest_parked_age_seconds=parked_age,
            delayed=delayed,
            upkeep=table_upkeep(conn),
        )
