"""Operating a large outbox: ``/v1/stats`` (``outbox status``) and ``outbox purge`` on 1,000,000
rows (almost all confirmed, a few thousand pending, in flight and failed), next to what they
replaced in the same run: the count by status that reads every row, and the purge whose every
chunk searched the table from its start.

The console's pages are timed on the same table, server side (in process through ASGI, signed
in as an operator): issue #28 wants every page under 300 ms at 1,000,000 rows.

Each run builds the table fresh (``tests/support/large_outbox.py``'s builder, then
``VACUUM ANALYZE`` as autovacuum would), so a purge always finds the same ~49,600 rows past an
11-day retention. Figures are milliseconds per call (stats) and per whole purge.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import statistics
import time
from collections.abc import Callable

from sqlalchemy import Engine, delete, select, text

from app.db import make_engine
from app.outbox.database import OutboxDatabase
from app.outbox.read.stats import read_stats
from app.outbox.retention import Retention
from app.outbox.schema import outbox
from app.outbox.states import Status
from bench.common import REPEATS, Measured, Services, Sizes, temp_postgres
from tests.support.large_outbox import NOW, ROWS, build

RETENTION = dt.timedelta(days=11)
CHUNK = 10_000


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _stats(engine: Engine) -> object:
    window = dt.timedelta(minutes=15)
    return read_stats(engine, now=NOW, alive_after=15.0, latency_window=window, latency_rows=1000)


def _full_scan_counts(engine: Engine) -> object:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT status, count(*), sum(lost_confirms) FROM outbox GROUP BY status")
        ).all()


def _old_purge(engine: Engine) -> int:
    """The purge before the primary-key walk: each chunk a search from the table's start."""
    cutoff = NOW - RETENTION
    old = (
        select(outbox.c.id)
        .where(outbox.c.status == Status.CONFIRMED.value, outbox.c.confirmed_at < cutoff)
        .limit(CHUNK)
    )
    total = 0
    while True:
        with engine.begin() as conn:
            n = conn.execute(delete(outbox).where(outbox.c.id.in_(old.scalar_subquery()))).rowcount
        total += n
        if n < CHUNK:
            return total


def _timed_stats(engine: Engine) -> tuple[float, float]:
    """(best of 3 read_stats, best of 3 full-scan counts) in ms, each warmed once first."""
    _stats(engine)
    best = min(_ms(lambda: _stats(engine)) for _ in range(3))
    _full_scan_counts(engine)
    return best, min(_ms(lambda: _full_scan_counts(engine)) for _ in range(3))


def _timed_purge(engine: Engine, *, walk: bool) -> float:
    if not walk:
        return _ms(lambda: _old_purge(engine))
    retention = Retention(OutboxDatabase(engine, clock=lambda: NOW))
    return _ms(lambda: retention.purge_confirmed(older_than=RETENTION, chunk=CHUNK))


#: The console's pages an operator opens in an incident, on ``build``'s table.
CONSOLE_PAGES = {
    "overview": "/ui",
    "failures": "/ui/failures",
    "failed_messages": "/ui/messages?status=failed",
    "reason_search": "/ui/messages?reason=404",
    "routing_key_search": "/ui/messages?routing_key=r3",
    "batches": "/ui/batches",
    "batch": "/ui/batches/b:50",
    "message": "/ui/messages/m-400100",
    "outstanding": "/ui/outstanding",
    "parked": "/ui/parked",
    "audit": "/ui/audit",
}
_READ = "bench-read-Qv8Lm3Tz6Xc1Kw9Bn4Hd7Rp2Gy5Fs0"
_OPERATOR = "bench-oper-Zh3Kq7Wm1Lc8Xv4Bn6Td9Rp2Gy5Fs0"


async def _console_ms(url: str, engine: Engine) -> dict[str, float]:
    """The median of 5 renders of each console page (after one warm-up), in ms."""
    import httpx
    from pydantic import SecretStr

    from app.api import create_app
    from app.settings import Settings

    settings = Settings(
        database_url=SecretStr(url),
        api_token=SecretStr(_READ),
        operator_token=SecretStr(_OPERATOR),
        amqp_url=SecretStr("amqp://guest:guest@127.0.0.1:1/"),
    )
    app = create_app(settings, clock=lambda: NOW, engine=engine)
    base = "http://outbox.bench"
    out: dict[str, float] = {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=base) as client:
        signed = await client.post(
            "/ui/login", data={"token": _OPERATOR, "next": "/ui"}, headers={"origin": base}
        )
        if signed.status_code not in (200, 303) or not client.cookies:
            raise RuntimeError(f"console sign-in failed: {signed.status_code}")
        for name, path in CONSOLE_PAGES.items():
            times = []
            for _ in range(6):
                start = time.perf_counter()
                page = await client.get(path)
                times.append((time.perf_counter() - start) * 1000)
                if page.status_code != 200:
                    raise RuntimeError(f"console {path}: HTTP {page.status_code}")
            out[name] = statistics.median(times[1:])
    return out


def run(services: Services, sizes: Sizes) -> list[Measured]:
    pages = {name: Measured(key=f"console_{name}_1m_rows_ms", unit="ms") for name in CONSOLE_PAGES}
    slowest = Measured(key="console_slowest_page_1m_rows_ms", unit="ms")
    stats = Measured(key="stats_1m_rows_ms", unit="ms")
    scan = Measured(key="stats_1m_rows_full_scan_ms", unit="ms")
    purge = Measured(key="purge_1m_rows_ms", unit="ms")
    old = Measured(key="purge_1m_rows_search_from_start_ms", unit="ms")
    for i in range(REPEATS):
        for walk, target in ((True, purge), (False, old)):
            with temp_postgres(services) as url:
                engine = make_engine(url)
                try:
                    build(engine)
                    if walk:
                        figures = _timed_stats(engine)
                        stats.runs.append(figures[0])
                        scan.runs.append(figures[1])
                        rendered = asyncio.run(_console_ms(url, engine))
                        for name, ms in rendered.items():
                            pages[name].runs.append(ms)
                        worst = max(rendered, key=lambda n: rendered[n])
                        slowest.runs.append(rendered[worst])
                        print(
                            f"  console pages: slowest {worst} {rendered[worst]:,.0f} ms; "
                            + ", ".join(f"{n} {ms:,.0f}" for n, ms in rendered.items()),
                            flush=True,
                        )
                    target.runs.append(_timed_purge(engine, walk=walk))
                finally:
                    engine.dispose()
            print(f"  {target.key} run {i + 1}/{REPEATS}: {target.runs[-1]:,.0f} ms", flush=True)
        print(
            f"  {stats.key}: {stats.runs[-1]:,.1f} ms, {scan.key}: {scan.runs[-1]:,.1f} ms "
            f"({ROWS:,} rows)",
            flush=True,
        )
    return [stats, scan, purge, old, slowest, *pages.values()]
