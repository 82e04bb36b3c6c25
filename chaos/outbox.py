"""The runner's side of the outbox: scenario databases, the batch of rows, and what the rows say.

Plain SQL over the product's tables (read-only apart from inserting the batch), through
connections named ``chaos-runner`` so a fault aimed at the publisher's sessions spares them.
Every read retries while the database is away (a scenario restarts it).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, func, insert, make_url, select, text
from sqlalchemy.exc import DBAPIError

from app.db import make_engine, migrate
from app.outbox.ranges import DERIVED
from app.outbox.schema import outbox, publishers

RUNNER_APP = "chaos-runner"
KEEP_DB = "chaos_verifier"  # the verifier's records
T = TypeVar("T")


def runner_engine(url: str) -> Engine:
    return make_engine(
        url, connect_args={"application_name": RUNNER_APP, "connect_timeout": 5}, pool_pre_ping=True
    )


def retrying(fn: Callable[[], T], *, timeout: float = 60.0) -> T:
    """Call ``fn`` until it stops failing with a database error (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except DBAPIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Databases:
    """A migrated template on the private server; one fresh copy per scenario."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.admin = make_engine(
            admin_url, isolation_level="AUTOCOMMIT", connect_args={"application_name": RUNNER_APP}
        )
        self.template: str | None = None

    def url(self, name: str) -> str:
        return make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def _exec(self, sql: str) -> None:
        def run() -> None:
            with self.admin.connect() as conn:
                conn.execute(text(sql))

        retrying(run)

    def prepare(self) -> None:
        """Drop what earlier runs kept (their failed scenarios' databases), make a template."""
        for stale in self._names("chaos\\_%"):
            if stale != KEEP_DB:
                self.drop(stale)
        name = f"chaos_tmpl_{uuid.uuid4().hex[:8]}"
        self._exec(f'CREATE DATABASE "{name}"')
        migrate(self.url(name))
        self.template = name

    def _names(self, like: str) -> list[str]:
        def run() -> list[str]:
            with self.admin.connect() as conn:
                sql = text("SELECT datname FROM pg_database WHERE datname LIKE :p")
                return [n for (n,) in conn.execute(sql, {"p": like})]

        return retrying(run)

    def create(self, prefix: str) -> str:
        assert self.template is not None, "prepare() first"
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        self._exec(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        return name

    def ensure(self, name: str) -> str:
        def run() -> None:
            with self.admin.connect() as conn:
                found = conn.execute(
                    text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
                ).first()
                if found is None:
                    conn.execute(text(f'CREATE DATABASE "{name}"'))

        retrying(run)
        return self.url(name)

    def drop(self, name: str) -> None:
        self._exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def terminate(self, database: str, *, except_app: str = RUNNER_APP) -> int:
        """``pg_terminate_backend`` every session on ``database`` but the runner's."""
        sql = text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = :db AND pid <> pg_backend_pid() "
            "AND coalesce(application_name, '') <> :app"
        )

        def run() -> int:
            with self.admin.connect() as conn:
                return int(conn.execute(sql, {"db": database, "app": except_app}).scalar_one())

        return retrying(run)

    def dispose(self) -> None:
        if self.template is not None:
            self.drop(self.template)
        self.admin.dispose()


# ---------------------------------------------------------------- the batch


@dataclass(frozen=True)
class Expect:
    """Where a row must end: ``confirmed`` (and received), or a terminal failure whose
    ``reason`` (reply code or error text) contains ``needle``. ``or_confirmed``: either will do
    (a row whose exchange vanished mid-flow may have gone out before)."""

    status: str = "confirmed"
    needle: str = ""
    or_confirmed: bool = False


CONFIRMED = Expect()


@dataclass(frozen=True)
class PlannedRow:
    message_id: str
    exchange: str
    routing_key: str
    body: bytes
    expect: Expect = CONFIRMED
    max_attempts: int = 10
    ordering_key: str | None = None


def body_for(index: int, size: int = 256) -> bytes:
    head = f"chaos-row {index:07d} ".encode()
    return head + b"x" * max(0, size - len(head))


def insert_rows(
    engine: Engine, rows: Sequence[PlannedRow], *, batch_id: str, start: float, flow: float
) -> None:
    """Insert the batch; row ``i`` becomes due at ``start + flow * i / len(rows)`` (wall clock,
    seconds since the epoch), so the rows reach the publisher as a steady flow."""
    n = max(1, len(rows))
    values: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        due = dt.datetime.fromtimestamp(start + flow * i / n, tz=dt.UTC)
        values.append(
            {
                "message_id": row.message_id,
                "batch_id": batch_id,
                "exchange": row.exchange,
                "routing_key": row.routing_key,
                "body": row.body,
                "available_at": due,
                "max_attempts": row.max_attempts,
                "ordering_key": row.ordering_key,
            }
        )
    with engine.begin() as conn:
        for at in range(0, len(values), 5000):
            conn.execute(insert(outbox), values[at : at + 5000])


# ---------------------------------------------------------------- reads


#: Every row's status as a reader derives it, and who holds it in flight (publishers settling by
#: ranges, ``CHAOS_SETTLEMENT=ranges``: a range's members keep ``pending`` in their own column).
DERIVED_ROWS = "SELECT * FROM (" + DERIVED.replace("{where}", "") + ") d"


def _ranged(conn: Connection) -> bool:
    """Does this outbox settle by ranges (has it any)? Then statuses are derived."""
    if conn.dialect.name != "postgresql":
        return False
    return bool(conn.exec_driver_sql("SELECT EXISTS (SELECT 1 FROM outbox_ranges)").scalar())


def status_counts(engine: Engine) -> collections.Counter[str]:
    def run() -> collections.Counter[str]:
        with engine.connect() as conn:
            if _ranged(conn):
                sql = f"SELECT status, count(*) FROM ({DERIVED_ROWS}) s GROUP BY status"
                return collections.Counter({s: int(n) for s, n in conn.exec_driver_sql(sql)})
            stmt = select(outbox.c.status, func.count()).group_by(outbox.c.status)
            return collections.Counter({s: int(n) for s, n in conn.execute(stmt)})

    return retrying(run)


def _in_flight(conn: Connection, owner: str | None) -> set[str]:
    if _ranged(conn):
        sql = f"SELECT message_id FROM ({DERIVED_ROWS}) s WHERE status = 'in_flight'"
        if owner is not None:
            sql += " AND owner = %(owner)s"
        return {m for (m,) in conn.exec_driver_sql(sql, {"owner": owner})}
    stmt = select(outbox.c.message_id).where(outbox.c.status == "in_flight")
    if owner is not None:
        stmt = stmt.where(outbox.c.lease_owner == owner)
    return {m for (m,) in conn.execute(stmt)}


def in_flight_ids(engine: Engine, *, owner: str | None = None) -> set[str]:
    def run() -> set[str]:
        with engine.connect() as conn:
            return _in_flight(conn, owner)

    return retrying(run)


def in_flight_during(engine: Engine, action: Callable[[], T]) -> tuple[set[str], T]:
    """The rows in flight while ``action`` runs (a fault), with no row able to join them meanwhile.

    A SHARE lock on the outbox makes every claim (an UPDATE) wait until ``action`` has returned,
    so no row is claimed, and so none is published, between the read and the fault. Reading first
    and faulting after, without the lock, misses the rows a publisher claims in between.
    Write-backs wait too, which only keeps settled rows in the set a little longer."""
    with engine.connect() as conn, conn.begin():
        conn.execute(text("LOCK TABLE outbox IN SHARE MODE"))
        if _ranged(conn):  # a range claim writes its range row: no claim either
            conn.execute(text("LOCK TABLE outbox_ranges IN SHARE MODE"))
        ids = _in_flight(conn, None)
        return ids, action()


@dataclass(frozen=True)
class FinalRow:
    message_id: str
    status: str
    attempts: int
    nacks: int
    lost_confirms: int
    reply_code: int | None
    reply_text: str | None
    last_error: str | None
    confirmed_at: dt.datetime | None

    @property
    def reason(self) -> str:
        if self.reply_code is not None:
            return f"{self.reply_code} {self.reply_text or ''}".strip()
        return self.last_error or ""


def final_rows(engine: Engine) -> list[FinalRow]:
    cols = [outbox.c[name] for name in FinalRow.__dataclass_fields__]

    def run() -> list[FinalRow]:
        with engine.connect() as conn:
            rows = [FinalRow(**r._asdict()) for r in conn.execute(select(*cols))]
            if not _ranged(conn):
                return rows
            sql = f"SELECT message_id, status FROM ({DERIVED_ROWS}) s"
            derived = {m: status for m, status in conn.exec_driver_sql(sql)}
        return [dataclasses.replace(r, status=derived[r.message_id]) for r in rows]

    return retrying(run)


def publisher_stats(engine: Engine) -> dict[str, dict[str, Any]]:
    """``outbox_publishers.stats`` by publisher id (the last heartbeat's, or the final ones)."""

    def run() -> dict[str, dict[str, Any]]:
        stmt = select(publishers.c.publisher_id, publishers.c.stats)
        with engine.connect() as conn:
            return {pid: dict(stats or {}) for pid, stats in conn.execute(stmt)}

    return retrying(run)


def registered(engine: Engine, publisher_id: str) -> bool:
    def run() -> bool:
        stmt = select(func.count()).where(publishers.c.publisher_id == publisher_id)
        with engine.connect() as conn:
            return int(conn.execute(stmt).scalar_one()) > 0

    return retrying(run)


def batches_recorded(engine: Engine, sink: str) -> int:
    def run() -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM outbox_batches WHERE sink = :s"), {"s": sink}
                ).scalar_one()
            )

    return retrying(run)


def last_id(engine: Engine) -> int:
    """The highest row id now (0 when empty): a mark for :func:`open_up_to`."""

    def run() -> int:
        with engine.connect() as conn:
            return int(conn.execute(select(func.coalesce(func.max(outbox.c.id), 0))).scalar_one())

    return retrying(run)


def open_up_to(engine: Engine, mark: int) -> int:
    """Rows with an id up to ``mark`` still ``pending`` or ``in_flight``."""
    stmt = (
        select(func.count())
        .where(outbox.c.id <= mark)
        .where(outbox.c.status.in_(("pending", "in_flight")))
    )

    def run() -> int:
        with engine.connect() as conn:
            if _ranged(conn):
                sql = (
                    f"SELECT count(*) FROM ({DERIVED_ROWS}) s WHERE id <= %(mark)s "
                    "AND status IN ('pending', 'in_flight')"
                )
                return int(conn.exec_driver_sql(sql, {"mark": mark}).scalar_one())
            return int(conn.execute(stmt).scalar_one())

    return retrying(run)
