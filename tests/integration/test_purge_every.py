"""``outbox purge --every``: retention as a steady trickle, run as the real command (a process
of its own, stopped by SIGTERM), against PostgreSQL and SQLite, and through a database that
refuses connections for seconds."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select, update

from app.db import make_engine
from app.outbox.schema import audit, outbox
from tests.support.env import scrubbed_environ
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients
from tests.support.pgfaults import database_refusing

EVERY = "0.2"


def _settle(engine: Engine, n: int, *, days_ago: float, fail: bool = False) -> list[int]:
    """``n`` rows written, claimed and confirmed (or failed) ``days_ago`` days ago (the purge's
    walk relies on a row being confirmed after it was written)."""
    add_rows(engine, n=n)
    store = OutboxClients(engine).store
    rows = store.claim(owner="p", limit=n, lease_seconds=30)
    ids = [r.id for r in rows]
    assert len(ids) == n
    when = dt.datetime.now(dt.UTC) - dt.timedelta(days=days_ago)
    if not fail:
        store.mark_confirmed(owner="p", ids=ids)
    else:
        store.mark_failed(owner="p", ids=ids, reason="a test's failure")
    confirmed = {} if fail else {"confirmed_at": when}
    with engine.begin() as conn:
        conn.execute(
            update(outbox).where(outbox.c.id.in_(ids)).values(created_at=when, **confirmed)
        )
    return ids


def _left(engine: Engine, ids: list[int]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(outbox.c.id.in_(ids))).scalar_one())


def _until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextmanager
def _purging(url: str, *extra: str) -> Iterator[subprocess.Popen[str]]:
    env = scrubbed_environ(os.environ)
    env["OUTBOX_DATABASE_URL"] = url
    argv = [sys.executable, "-m", "app.cli", "purge", "--every", EVERY, "--audit-every", "1"]
    proc = subprocess.Popen(
        [*argv, "--older-than-days", "7", "--chunk", "7", "--actor", "retention", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, (out, err)
    return out, err


def _audited(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(audit).where(audit.c.action == "purge").order_by(audit.c.id))
        return [dict(r) for r in rows.mappings()]


def test_every_pass_deletes_what_passed_retention_and_the_audit_counts_each_row(
    db_url: str,
) -> None:
    engine = make_engine(db_url)
    try:
        old = _settle(engine, 30, days_ago=10)
        aging = _settle(engine, 20, days_ago=6)  # one more day and they are past retention
        failed = _settle(engine, 5, days_ago=5, fail=True)
        fresh = _settle(engine, 10, days_ago=1)
        with _purging(db_url) as proc:
            _until(lambda: _left(engine, old) == 0, "the rows past retention gone")
            time.sleep(0.6)  # a few more passes: nothing else is past retention yet
            assert _left(engine, aging) == 20
            eight = dt.datetime.now(dt.UTC) - dt.timedelta(days=8)
            with engine.begin() as conn:  # time passes for them: now 8 days old
                conn.execute(
                    update(outbox)
                    .where(outbox.c.id.in_(aging))
                    .values(created_at=eight, confirmed_at=eight)
                )
            _until(lambda: _left(engine, aging) == 0, "the rows that aged past retention gone")
            out, err = _stop(proc)
        assert _left(engine, fresh) == 10 and _left(engine, failed) == 5
        rows = _audited(engine)
        assert rows and sum(r["count"] for r in rows) == 50, rows
        assert all(r["actor"] == "retention" for r in rows)
        assert all(
            r["filter"] == {"older_than_days": 7, "sleep_coef": 0, "every_s": 0.2} for r in rows
        )
        assert sum(r["result"]["passes"] for r in rows) >= 2
        # one line per audit row, then the totals at the stop; no failure
        lines = out.splitlines()
        assert len([line for line in lines if line.startswith("deleted ")]) == len(rows)
        assert "stopped after" in lines[-1] and "50 confirmed rows" in lines[-1], out
        assert "a pass failed" not in err, err
    finally:
        engine.dispose()


def test_a_database_that_refuses_connections_pauses_the_passes_and_loses_no_count(
    pg_url: str, service_urls: dict[str, str]
) -> None:
    """Also what /metrics and /readyz show meanwhile (``--metrics-port``): the refused passes
    counted as failed, not ready while they fail, the deleted rows counted once each."""
    engine = make_engine(pg_url)
    try:
        first = _settle(engine, 20, days_ago=10)
        with _purging(pg_url, "--metrics-port", "0") as proc:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert line.startswith("outbox purge: metrics on http://127.0.0.1:"), line
            base = line.split(" on ", 1)[1].strip().removesuffix("/metrics")
            _until(lambda: _left(engine, first) == 0, "the first rows gone")
            _until(lambda: _probe(base, "/readyz")[0] == 200, "ready")
            engine.dispose()
            with database_refusing(service_urls["pg"], pg_url):  # refused for 3 s
                _until(
                    lambda: _metric(base, 'outbox_purge_passes_total{result="failed"}') >= 2,
                    "failed passes counted",
                )
                status, doc = _probe(base, "/readyz")
                assert status == 503 and "failing" in doc, doc
                assert _probe(base, "/healthz")[0] == 200
                time.sleep(3.0)
                assert proc.poll() is None, "the purge must outlive the outage"
            second = _settle(engine, 20, days_ago=10)
            _until(lambda: _left(engine, second) == 0, "the rows written after the outage gone")
            _until(lambda: _probe(base, "/readyz")[0] == 200, "ready again")
            # the rows go as each chunk commits, the counter when its pass ends
            deleted_total = 'outbox_purge_deleted_rows_total{table="outbox"}'
            _until(lambda: _metric(base, deleted_total) >= 40, "the deletes counted")
            deleted = _metric(base, deleted_total)
            # read first: a pass may end while /metrics is scraped, after a time taken before
            last_success = _metric(base, "outbox_purge_last_success_timestamp_seconds")
            since = time.time() - last_success
            out, err = _stop(proc)
        assert deleted == 40 and 0 <= since < 5, (deleted, since)
        assert "a pass failed, the next in 0.2 s" in err, err
        assert "Traceback" not in err
        rows = _audited(engine)
        assert sum(r["count"] for r in rows) == 40, rows
        assert "40 confirmed rows" in out.splitlines()[-1], out
    finally:
        engine.dispose()


def _probe(base: str, path: str) -> tuple[int, dict[str, Any]]:
    r = httpx.get(base + path, timeout=5)
    return r.status_code, r.json()


def _metric(base: str, sample: str) -> float:
    """One sample's value from /metrics (``name{labels}`` as exposed)."""
    text = httpx.get(base + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in /metrics:\n{text}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_writes_the_last_audit_row_at_once(sqlite_url: str, sig: signal.Signals) -> None:
    engine = make_engine(sqlite_url)
    try:
        old = _settle(engine, 12, days_ago=9)
        with _purging(sqlite_url, "--audit-every", "3600") as proc:
            _until(lambda: _left(engine, old) == 0, "the rows gone")
            assert _audited(engine) == []  # an hour's audit row is not due yet
            began = time.monotonic()
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0 and time.monotonic() - began < 5, (out, err)
        (row,) = _audited(engine)
        assert row["count"] == 12 and row["result"]["deleted"] == 12
    finally:
        engine.dispose()
