"""Play one broker schedule against the real publisher on a SQLite outbox of its own, and
check the run with the reference model (:mod:`tests.conformance.schedules`)."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

from sqlalchemy import Engine, insert

from app.db import make_engine
from app.outbox.schema import outbox
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
        async with FakeBroker() as broker:
            driver = Driver(broker, schedule, fates)
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
            async with running_publisher(config, engine):
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
            script_failures=script_failures(driver.records),
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
