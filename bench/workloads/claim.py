"""The claim's time as history piles up behind it (issue #30): on a fresh outbox, then behind
1,000,000 rows that were claimed, confirmed and purged with no VACUUM since (two outboxes,
measured in turn), and (the plain alternative, same table, same run) behind them with every
claim walking ``ix_outbox_due`` from its first entry, as the claim did before it remembered a
floor.

Each row claimed or purged leaves its entry in ``ix_outbox_due`` until a VACUUM removes it, and
a walk from the index's first entry steps over every one of them. Autovacuum is switched off on
the table for the run: the worst case, a table whose vacuum lags the traffic (a busy hour, a long
transaction holding the horizon back).

A measurement is ``CLAIMS`` claims of ``CLAIM_ROWS`` rows by the product's ``PublisherStore``
(one publisher's repository, its floor and its walk from the start once per ``CLAIM_REWALK``),
paced at ``CLAIMS_PER_S`` as a publisher draining about 15,000 rows/s claims, each claim's rows
then confirmed as the write-back would. Figures are the median claim in milliseconds; the mean
(which carries the walks from the start) and the p99 go in ``extra``.
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from unittest import mock

from sqlalchemy import Engine, text

import app.outbox.store as store_module
from app.db import make_engine
from app.outbox.retention import Retention
from app.outbox.store import PublisherStore
from bench.common import REPEATS, Measured, Services, Sizes, temp_postgres

CLAIM_ROWS = 150
CLAIMS = 300
CLAIMS_PER_S = 100.0
HISTORY_ROWS = 1_000_000
OWNER = "bench-claim"


def _insert(engine: Engine, n: int, *, prefix: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body) "
                "SELECT :prefix || g, :prefix || (g / 100000), 'bench', 'claim', "
                "decode(repeat('ab', 128), 'hex') FROM generate_series(1, :n) g"
            ),
            {"prefix": prefix, "n": n},
        )


def _history(engine: Engine) -> int:
    """1,000,000 rows written pending, confirmed (as claims and confirms leave them) and purged:
    every one leaves its dead entry in ``ix_outbox_due``. Returns the rows purged."""
    step = 100_000
    for i in range(HISTORY_ROWS // step):
        _insert(engine, step, prefix=f"history-{i}-")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE outbox SET status = 'in_flight', attempts = 1, lease_owner = 'old', "
                    "lease_until = now() WHERE status = 'pending'"
                )
            )
            conn.execute(
                text(
                    "UPDATE outbox SET status = 'confirmed', confirmed_at = now(), "
                    "lease_owner = NULL, lease_until = NULL WHERE status = 'in_flight'"
                )
            )
    # every confirmed row goes, the fresh measurements' too (a zero retention)
    return Retention(engine).purge_confirmed(older_than=dt.timedelta(0), chunk=10_000)


def _claims(engine: Engine, *, prefix: str) -> list[float]:
    """``CLAIMS`` paced claims of ``CLAIM_ROWS`` rows by a new publisher's repository; each
    claim's rows confirmed after it. The claim times, in ms."""
    _insert(engine, CLAIMS * CLAIM_ROWS, prefix=prefix)
    store = PublisherStore(engine)
    times: list[float] = []
    start = time.monotonic()
    for i in range(CLAIMS):
        pause = start + i / CLAIMS_PER_S - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        began = time.perf_counter()
        rows = store.claim(owner=OWNER, limit=CLAIM_ROWS, lease_seconds=60)
        times.append((time.perf_counter() - began) * 1000)
        if len(rows) != CLAIM_ROWS:
            raise RuntimeError(f"claim {i} took {len(rows)} rows, not {CLAIM_ROWS}")
        store.mark_confirmed(owner=OWNER, ids=[r.id for r in rows])
    return times


def _measure(key: str, runs: list[list[float]]) -> Measured:
    return Measured(
        key=key,
        unit="ms",
        runs=[statistics.median(t) for t in runs],
        extra={
            "mean_ms": [round(statistics.fmean(t), 3) for t in runs],
            "p99_ms": [round(sorted(t)[int(len(t) * 0.99) - 1], 3) for t in runs],
            "max_ms": [round(max(t), 3) for t in runs],
        },
    )


def run(services: Services, sizes: Sizes) -> list[Measured]:
    """Two outboxes, one fresh and one with the history behind it, measured in turn (fresh,
    behind, behind from the start; ``REPEATS`` times), so a slow minute of the machine falls on
    all three alike."""
    fresh: list[list[float]] = []
    behind: list[list[float]] = []
    from_start: list[list[float]] = []
    with temp_postgres(services) as old_url, temp_postgres(services) as new_url:
        old, new = make_engine(old_url), make_engine(new_url)
        try:
            for engine in (old, new):
                with engine.begin() as conn:
                    conn.execute(text("ALTER TABLE outbox SET (autovacuum_enabled = false)"))
            started = time.monotonic()
            purged = _history(old)
            if purged < HISTORY_ROWS:
                raise RuntimeError(f"the purge deleted {purged:,} rows, not {HISTORY_ROWS:,}")
            print(
                f"  history: {purged:,} rows written, confirmed and purged in "
                f"{time.monotonic() - started:.0f} s, no VACUUM",
                flush=True,
            )
            for i in range(REPEATS):
                fresh.append(_claims(new, prefix=f"fresh-{i}-"))
                behind.append(_claims(old, prefix=f"behind-{i}-"))
                with mock.patch.object(store_module, "CLAIM_REWALK", dt.timedelta(0)):
                    from_start.append(_claims(old, prefix=f"start-{i}-"))
        finally:
            old.dispose()
            new.dispose()
    out = [
        _measure("claim_ms_fresh", fresh),
        _measure("claim_ms_1m_purged_behind", behind),
        _measure("claim_ms_1m_purged_behind_walk_from_start", from_start),
    ]
    for m in out:
        print(
            f"  {m.key}: median {m.value:.2f} ms, mean {m.extra['mean_ms']}, "
            f"p99 {m.extra['p99_ms']}",
            flush=True,
        )
    return out
