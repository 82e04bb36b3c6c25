"""The publisher as a real process (``python -m app.publisher``): kill -9 and SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from app.db import make_engine
from app.outbox.schema import outbox
from tests.support.factories import add_rows
from tests.support.publisher import (
    consume_ids,
    declare,
    delete,
    rows,
    run_until_empty,
    settings_for,
)

REPO = Path(__file__).resolve().parents[2]
WINDOW = 1000


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    eng = make_engine(pg_url)
    yield eng
    eng.dispose()


@pytest.fixture
async def topology(amqp_url: str) -> AsyncIterator[dict[str, str]]:
    names = {
        "exchange": f"test-proc-ex-{uuid.uuid4().hex[:8]}",
        "queue": f"test-proc-q-{uuid.uuid4().hex[:8]}",
    }
    await declare(amqp_url, exchange=names["exchange"], queue=names["queue"])
    yield names
    await delete(amqp_url, exchanges=(names["exchange"],), queues=(names["queue"],))


def _spawn(pg_url: str, amqp_url: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
    environ = {
        **os.environ,
        "OUTBOX_DATABASE_URL": pg_url,
        "OUTBOX_AMQP_URL": amqp_url,
        "OUTBOX_WINDOW": str(WINDOW),
        "OUTBOX_CLAIM_BATCH": "250",
        "OUTBOX_LEASE_SECONDS": "2",
        "OUTBOX_POLL_INTERVAL": "0.05",
        "OUTBOX_SHUTDOWN_TIMEOUT": "5",
        "OUTBOX_PUBLISHER_METRICS_PORT": "0",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "app.publisher", *args],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _confirmed(engine: Engine) -> int:
    with engine.connect() as conn:
        stmt = select(func.count()).where(outbox.c.status == "confirmed")
        return int(conn.execute(stmt).scalar_one())


async def _wait_confirmed(engine: Engine, proc: subprocess.Popen[bytes], at_least: int) -> None:
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(_confirmed, engine) < at_least:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, "the publisher made no progress"
        await asyncio.sleep(0.02)


async def test_kill_9_mid_window_then_restart_loses_nothing(
    pg_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    ids = add_rows(engine, n=20_000, exchange=topology["exchange"])
    proc = _spawn(pg_url, amqp_url)
    try:
        await _wait_confirmed(engine, proc, 3000)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    killed_at = rows(engine)
    in_flight = sum(r.status == "in_flight" for r in killed_at)
    assert 0 < sum(r.status == "confirmed" for r in killed_at) < len(ids)
    restart = _spawn(pg_url, amqp_url, "--until-empty")
    out, _ = await asyncio.to_thread(restart.communicate, timeout=120)
    assert restart.returncode == 0, out.decode()
    final = rows(engine)
    assert all(r.status == "confirmed" for r in final), "a row was lost"
    seen = await consume_ids(amqp_url, topology["queue"], expect=len(ids), timeout=120)
    assert set(seen) == set(ids)
    duplicates = sum(seen.values()) - len(seen)
    assert duplicates <= WINDOW, f"{duplicates} duplicates, more than the window"
    assert duplicates <= in_flight
    assert duplicates <= sum(r.lost_confirms for r in final), "a duplicate went uncounted"
    print(
        f"kill -9 with {in_flight} rows in flight: {duplicates} duplicates, "
        f"lost_confirms counted {sum(r.lost_confirms for r in final)}"
    )


async def test_sigterm_settles_the_window_and_releases_the_rest(
    pg_url: str, engine: Engine, amqp_url: str, topology: dict[str, str]
) -> None:
    ids = add_rows(engine, n=20_000, exchange=topology["exchange"])
    proc = _spawn(pg_url, amqp_url)
    try:
        await _wait_confirmed(engine, proc, 3000)
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()
    stopped = rows(engine)
    assert not [r for r in stopped if r.status == "in_flight"], "rows left in flight"
    assert {r.status for r in stopped} == {"confirmed", "pending"}
    assert sum(r.lost_confirms for r in stopped) == 0  # a live broker settles the window in time
    stats = await run_until_empty(settings_for(db_url=pg_url, amqp_url=amqp_url), engine)
    assert stats.confirmed == sum(r.status == "pending" for r in stopped)
    seen = await consume_ids(amqp_url, topology["queue"], expect=len(ids), timeout=120)
    assert set(seen) == set(ids) and set(seen.values()) == {1}
