"""Play one broker schedule against the real publisher on a SQLite outbox of its own, and
check the run with the reference model (:mod:`tests.conformance.schedules`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, update
from sqlalchemy.exc import OperationalError

from app.db import make_engine
from app.outbox.database import OutboxDatabase
from app.outbox.schema import outbox
from app.outbox.store import PublisherStore
from tests.conformance.schedules import (
    Driver,
    Limits,
    RowEnd,
    Schedule,
    describe,
    fates_of,
    row_values,
    script_failures,
    violations,
)
from tests.support.fakebroker import FakeBroker
from tests.support.publisher import FAST, rows, running_publisher, settings_for

#: the publisher's timings, scaled down so that a schedule plays in well under a second
TIMINGS = {
    **FAST,
    "backoff_base": 0.02,
    "backoff_max": 0.2,
    "confirm_timeout": 1.0,
    "shutdown_timeout": 1.0,
    "destination_nack_burst": 3,
    "destination_outage_after": 0.15,
    "destination_outage_max_wait": 0.6,
    "return_grace": 0.3,
}
#: every row has ended this long after the broker turned healthy
SETTLE_BOUND = 12.0


class LosingDatabase(OutboxDatabase):
    """The real outbox database, which can lose its last commits on a schedule's ``Undo``: a
    row set back to before its write-back (or its claim), then the next call of the publisher
    fails once, as on a connection to a server that failed over or crashed."""

    owner = ""
    armed = False

    def undo(self, message_id: str, claim: bool) -> bool:
        row = outbox.c.message_id == message_id
        with self.engine.begin() as conn:
            status = conn.execute(select(outbox.c.status).where(row)).scalar_one()
            if claim and status in ("confirmed", "in_flight"):
                values: dict[str, Any] = {
                    "status": "pending",
                    "lease_owner": None,
                    "lease_until": None,
                    "published_at": None,
                    "confirmed_at": None,
                    "attempts": outbox.c.attempts - 1,
                }
            elif not claim and status == "confirmed":
                values = {
                    "status": "in_flight",
                    "confirmed_at": None,
                    "lease_owner": self.owner,
                    "lease_until": self.clock() + dt.timedelta(seconds=30),
                }
            else:
                return False
            conn.execute(update(outbox).where(row).values(**values))
        self.armed = True
        return True

    def _fail_once(self) -> None:
        if self.armed and getattr(self._local, "conn", None) is None:
            self.armed = False
            raise OperationalError("BEGIN", {}, Exception("server closed the connection"))

    @contextlib.contextmanager
    def unit_of_work(
        self, *, durable: bool = True, by_id: bool = False, positions: bool = False
    ) -> Iterator[None]:
        self._fail_once()
        with super().unit_of_work(durable=durable, by_id=by_id, positions=positions):
            yield

    @contextlib.contextmanager
    def begin(self, *, by_id: bool = False) -> Iterator[Connection]:
        self._fail_once()
        with super().begin(by_id=by_id) as conn:
            yield conn


def _ends(engine: Engine) -> list[RowEnd]:
    return [
        RowEnd(r.message_id, r.status, r.attempts, r.nacks, r.lost_confirms) for r in rows(engine)
    ]


async def _until_ended(engine: Engine, bound: float) -> list[RowEnd]:
    deadline = time.monotonic() + bound
    while True:
        ends = await asyncio.to_thread(_ends, engine)
        if all(e.status not in ("pending", "in_flight") for e in ends):
            return ends
        if time.monotonic() > deadline:
            return ends
        await asyncio.sleep(0.02)


async def play(schedule: Schedule, template: Path, workdir: Path) -> None:
    """One schedule, start to end; raises AssertionError with the run when the model objects."""
    path = workdir / f"{uuid.uuid4().hex}.db"
    shutil.copyfile(template, path)
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    try:
        ids = [f"m{i}" for i in range(len(schedule.rows))]
        with engine.begin() as conn:
            conn.execute(
                insert(outbox),
                [
                    {
                        "message_id": m,
                        "batch_id": "conf:1",
                        "routing_key": "rk",
                        "body": b"x",
                        **row_values(spec),
                    }
                    for m, spec in zip(ids, schedule.rows, strict=True)
                ],
            )
        fates = fates_of(ids, schedule)
        db = LosingDatabase(engine)
        async with FakeBroker() as broker:
            driver = Driver(broker, schedule, fates, undo=db.undo)
            config = settings_for(
                db_url=url,
                amqp_url=broker.url,
                **{
                    **TIMINGS,
                    "window": schedule.window,
                    "claim_batch": min(schedule.window, 50),
                    "channels": schedule.channels,
                },
            )
            async with running_publisher(config, engine, store=PublisherStore(db)) as publisher:
                db.owner = publisher.publisher_id
                await driver.play()
                healthy = asyncio.create_task(driver.keep_healthy())
                try:
                    ends = await _until_ended(engine, SETTLE_BOUND)
                finally:
                    healthy.cancel()
        driver.outstanding()  # the last publishes into the record
        problems = violations(
            ends=ends,
            records=driver.records,
            fates=fates,
            limits=Limits(
                return_grace=TIMINGS["return_grace"], backoff_base=TIMINGS["backoff_base"]
            ),
            script_failures=script_failures(driver.records) + driver.undone,
            undone_claims=driver.undone_claims,
            claims_lost_at=driver.claims_lost_at,
        )
        if problems:
            raise AssertionError(
                "\n".join(problems)
                + f"\n\nschedule: {schedule}\n"
                + describe(driver.records, ends, driver.log)
            )
    finally:
        engine.dispose()
        path.unlink(missing_ok=True)
