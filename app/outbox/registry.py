"""The publishers' registry: who runs, its heartbeat and counters, the leases of its rows, and
on SQLite the one publisher allowed at a time."""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    delete,
    exists,
    func,
    insert,
    literal,
    select,
    update,
)

from app.outbox.database import OutboxDatabase, OutboxError
from app.outbox.schema import outbox, publishers, samples
from app.outbox.states import Status


class PublisherLocked(OutboxError):
    """A second publisher tried to start on a SQLite outbox that another live publisher holds."""


class PublisherRegistry:
    """The ``publishers`` table and the leases its heartbeats extend."""

    def __init__(self, db: OutboxDatabase | Engine) -> None:
        self.db = OutboxDatabase.of(db)

    def register_publisher(self, *, publisher_id: str, stale_after: float) -> dict[str, Any] | None:
        """Record this publisher; return the last stats of an earlier run with the same id (its
        counters continue from them). On SQLite, refuse when another live publisher holds the
        outbox."""
        now = self.db.clock()
        row = {
            "publisher_id": publisher_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": now,
            "heartbeat_at": now,
            "stopped_at": None,
        }
        with self.db.begin() as conn:
            before = conn.execute(
                select(publishers.c.stats).where(publishers.c.publisher_id == publisher_id)
            ).scalar()
            if not self.db.is_postgres:
                self._register_sole(conn, row, cutoff=now - dt.timedelta(seconds=stale_after))
            else:
                conn.execute(delete(publishers).where(publishers.c.publisher_id == publisher_id))
                conn.execute(insert(publishers).values(**row))
        return before if isinstance(before, dict) else None

    def _register_sole(self, conn: Connection, row: dict[str, Any], *, cutoff: dt.datetime) -> None:
        me = row["publisher_id"]
        others = select(publishers).where(
            publishers.c.publisher_id != me,
            publishers.c.stopped_at.is_(None),
            publishers.c.heartbeat_at > cutoff,
        )
        # One statement: SQLite takes its write lock for it, so two starters cannot both pass.
        conn.execute(delete(publishers).where(publishers.c.publisher_id == me, ~exists(others)))
        cols = list(row)
        values = select(*[literal(row[c], type_=publishers.c[c].type) for c in cols])
        inserted = conn.execute(
            insert(publishers).from_select(cols, values.where(~exists(others)))
        ).rowcount
        if inserted:
            return
        holder = conn.execute(others.limit(1)).mappings().first()
        assert holder is not None
        raise PublisherLocked(
            f"another publisher {holder['publisher_id']!r} (pid {holder['pid']} on "
            f"{holder['hostname']}) holds this SQLite outbox; "
            "SQLite allows one publisher at a time: "
            "stop it, or move the outbox to PostgreSQL to run several"
        )

    def heartbeat(
        self,
        *,
        publisher_id: str,
        lease_seconds: float,
        stats: dict[str, Any] | None = None,
        held: Sequence[int] | None = None,
    ) -> int:
        """Refresh this publisher's heartbeat (and its counters, for the API's /metrics) and
        extend the leases of its rows. Returns how many leases were extended.

        ``held``: extend only these rows, the ones the process knows it holds. A row leased to
        this owner but unknown to the process (its claim's reply was lost) then expires and comes
        back through :meth:`release_expired` instead of being renewed forever.
        """
        now = self.db.clock()
        beat: dict[str, Any] = {"heartbeat_at": now, "stopped_at": None}
        if stats is not None:
            beat["stats"] = stats
        with self.db.begin(by_id=bool(held)) as conn:  # the renewal below finds rows by id
            conn.execute(
                update(publishers).where(publishers.c.publisher_id == publisher_id).values(**beat)
            )
            if held is not None and not held:
                return 0
            renew = update(outbox).values(lease_until=now + dt.timedelta(seconds=lease_seconds))
            if held is None:
                mine = (outbox.c.status == Status.IN_FLIGHT, outbox.c.lease_owner == publisher_id)
                return conn.execute(renew.where(*mine)).rowcount
            return sum(  # by id, whatever the statistics say (``held``)
                conn.execute(renew.where(self.db.held(publisher_id, chunk))).rowcount
                for chunk in self.db.chunks(held)
            )

    def unregister_publisher(
        self, *, publisher_id: str, stats: dict[str, Any] | None = None
    ) -> None:
        values: dict[str, Any] = {"stopped_at": self.db.clock()}
        if stats is not None:
            values["stats"] = stats
        with self.db.begin() as conn:
            conn.execute(
                update(publishers).where(publishers.c.publisher_id == publisher_id).values(**values)
            )

    def record_sample(
        self,
        *,
        publisher_id: str,
        published: int,
        confirmed: int,
        failed: int,
        lost: int,
        latency_p50_ms: float | None,
        latency_p99_ms: float | None,
    ) -> None:
        """This publisher's figures now (cumulative counters, the latency since its last
        sample), with the outbox's highest id read in the same statement."""
        top = select(func.max(outbox.c.id)).scalar_subquery()
        row = {
            "at": self.db.clock(),
            "publisher_id": publisher_id,
            "published": published,
            "confirmed": confirmed,
            "failed": failed,
            "lost": lost,
            "latency_p50_ms": latency_p50_ms,
            "latency_p99_ms": latency_p99_ms,
        }
        names = [*row, "max_id"]
        values = select(*[literal(v, samples.c[k].type) for k, v in row.items()], top)
        with self.db.begin() as conn:
            conn.execute(insert(samples).from_select(names, values))
