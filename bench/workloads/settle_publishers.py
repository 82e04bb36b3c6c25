"""Issue 47's open question on the range settlement: several publishers claiming from one cursor.

Ranges are taken in (xid, id) order past a single cursor row, so every claim locks that row and
the claims of all publishers take turns; today's claims walk ``ix_outbox_due`` with ``FOR UPDATE
SKIP LOCKED`` and never wait for one another. Here ``k`` publishers (1, 2, 4: one thread and one
connection each) drain ``ROWS`` rows, each claiming ``CLAIM_ROWS`` and then writing that claim's
confirm, until a claim finds nothing:

- ``ranges``: :mod:`bench.workloads.settle`'s statements (the cursor locked, then one statement
  taking the rows, moving the cursor and recording the range; the confirm settles the range);
- ``today``: the product's ``PublisherStore.claim`` and confirm write-back, one owner a thread.

Per candidate and ``k``: rows/s, each claim's time (p50, p99: the wait for the cursor shows in
the tail), and the PostgreSQL server's CPU per row. Every row must be claimed exactly once: the
ranges' rows add up to ``ROWS`` and none overlaps, and today's rows all end ``confirmed``.
"""

from __future__ import annotations

import datetime as dt
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from app.db import make_engine
from app.outbox.records import Published
from app.outbox.store import PublisherStore
from bench.common import REPEATS, Measured, Services, libpq_url, temp_postgres
from bench.proccpu import ServiceCpu
from bench.workloads.settle import (
    BODY,
    CLAIM_ROWS,
    COLUMNS,
    RANGE_CLAIM,
    RANGE_CONFIRM,
    RANGE_CURSOR,
    ROWS,
    Ranges,
)

ROWS_DRAINED = 60_000
PUBLISHERS = (1, 2, 4)


class _Drain:
    """One candidate in its own database with ``ROWS_DRAINED`` rows; :meth:`run` drains them
    with ``k`` threads; per-claim times in ``claim_ms``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.claim_ms: list[float] = []
        self.lock = threading.Lock()

    def fill(self) -> None:
        raise NotImplementedError

    def worker(self, i: int) -> Callable[[], bool]:
        """A function that claims and confirms once; False when the claim found nothing."""
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def timed_claim(self, claim: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        got = claim()
        with self.lock:
            self.claim_ms.append((time.perf_counter() - began) * 1e3)
        return got

    def run(self, k: int) -> float:
        """Seconds for ``k`` threads to drain every row."""
        errors: list[BaseException] = []
        steps = [self.worker(i) for i in range(k)]

        def loop(step: Callable[[], bool]) -> None:
            try:
                while step():
                    pass
            except BaseException as exc:  # reported after the join
                errors.append(exc)

        threads = [threading.Thread(target=loop, args=(s,)) for s in steps]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - began


class _RangeDrain(_Drain):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.layout = Ranges(url)  # its tables, in this database
        self.conns: list[psycopg.Connection[Any]] = []

    def fill(self) -> None:
        self.layout.insert(ROWS_DRAINED)
        self.layout.conn.execute("ANALYZE r_outbox, r_ranges, r_cursor")

    def worker(self, i: int) -> Callable[[], bool]:
        conn = psycopg.connect(libpq_url(self.url), autocommit=True)
        self.conns.append(conn)

        def claim() -> Any:
            now = dt.datetime.now(dt.UTC)
            with conn.transaction():
                cx, ci = conn.execute(RANGE_CURSOR).fetchone()  # type: ignore[misc]
                until = now + dt.timedelta(seconds=60)
                values = {"n": CLAIM_ROWS, "until": until, "cx": cx, "ci": ci}
                return conn.execute(RANGE_CLAIM.format(t="r_outbox"), values).fetchall()

        def step() -> bool:
            rows = self.timed_claim(claim)
            if not rows:
                return False
            with conn.transaction():
                conn.execute("SET LOCAL synchronous_commit TO off")
                values = {"now": dt.datetime.now(dt.UTC), "r": rows[0][-2]}
                assert conn.execute(RANGE_CONFIRM, values).rowcount == 1
            return True

        return step

    def check(self) -> None:
        conn = self.layout.conn
        total, settled = conn.execute(  # type: ignore[misc]
            "SELECT sum(rows), count(*) FILTER (WHERE settled_at IS NULL) FROM r_ranges"
        ).fetchone()
        overlaps = conn.execute(
            "SELECT count(*) FROM (SELECT hi_xid, hi_id, lead(lo_xid) OVER w AS nx, "
            "lead(lo_id) OVER w AS ni FROM r_ranges WINDOW w AS (ORDER BY lo_xid, lo_id)) r "
            "WHERE nx IS NOT NULL AND (nx, ni) <> (hi_xid, hi_id)"
        ).fetchone()[0]  # type: ignore[index]
        if (total, settled, overlaps) != (ROWS_DRAINED, 0, 0):
            raise RuntimeError(
                f"ranges: {total} rows in ranges, {settled} unsettled, {overlaps} gaps"
            )

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.layout.close()


class _TodayDrain(_Drain):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.engine = make_engine(url, pool_size=8)
        self.tag = 0

    def fill(self) -> None:
        with psycopg.connect(libpq_url(self.url), autocommit=True) as conn:
            for first in range(1, ROWS_DRAINED + 1, 5_000):
                values = {"body": BODY, "first": first, "last": first + 4_999}
                conn.execute(f"INSERT INTO outbox ({COLUMNS}) {ROWS}", values)
            conn.execute("ANALYZE outbox")

    def worker(self, i: int) -> Callable[[], bool]:
        store = PublisherStore(self.engine)
        owner = f"p{i}"

        def step() -> bool:
            rows = self.timed_claim(
                lambda: store.claim(owner=owner, limit=CLAIM_ROWS, lease_seconds=60)
            )
            if not rows:
                return False
            now = dt.datetime.now(dt.UTC)
            with self.lock:
                first, self.tag = self.tag, self.tag + len(rows)
            published = [Published(r.id, i + 1, first + n, now) for n, r in enumerate(rows)]
            with store.db.unit_of_work(durable=False, by_id=True, positions=True):
                moved = store.mark_confirmed(owner=owner, published=published)
            assert moved == len(rows), (moved, len(rows))
            return True

        return step

    def check(self) -> None:
        with psycopg.connect(libpq_url(self.url)) as conn:
            n = conn.execute("SELECT count(*) FROM outbox WHERE status = 'confirmed'").fetchone()
        if n is None or n[0] != ROWS_DRAINED:
            raise RuntimeError(f"today: {n} rows confirmed of {ROWS_DRAINED}")

    def close(self) -> None:
        self.engine.dispose()


KINDS: dict[str, Callable[[str], _Drain]] = {"today": _TodayDrain, "ranges": _RangeDrain}


def run(services: Services, sizes: Any = None) -> list[Measured]:
    cpu = ServiceCpu(postgresql=services.database_port)
    found: dict[tuple[str, int], dict[str, list[float]]] = {}
    for i in range(REPEATS):
        for name in KINDS if i % 2 == 0 else reversed(list(KINDS)):
            for k in PUBLISHERS:
                with temp_postgres(services) as url:
                    drain = KINDS[name](url)
                    try:
                        drain.fill()
                        cpu.start()
                        seconds = drain.run(k)
                        pg = cpu.stop()["postgresql"]
                        drain.check()
                    finally:
                        drain.close()
                into = found.setdefault((name, k), {"rows": [], "p50": [], "p99": [], "pg": []})
                into["rows"].append(ROWS_DRAINED / seconds)
                into["p50"].append(statistics.median(drain.claim_ms))
                into["p99"].append(statistics.quantiles(drain.claim_ms, n=100)[98])
                into["pg"].append(pg / ROWS_DRAINED * 1e6)
    out = []
    for (name, k), f in found.items():
        extra = {
            "publishers": k,
            "claim_ms_p50": [round(v, 3) for v in f["p50"]],
            "claim_ms_p99": [round(v, 3) for v in f["p99"]],
            "pg_us_per_row": [round(v, 2) for v in f["pg"]],
        }
        m = Measured(key=f"settle_{name}_{k}_publishers_rows", unit="rows/s", runs=f["rows"])
        m.extra = extra
        print(
            f"  {name}, {k} publisher{'s' if k > 1 else ''}: {m.value:,.0f} rows/s, claim p50 "
            f"{statistics.median(f['p50']):.2f} ms, p99 {statistics.median(f['p99']):.2f} ms, "
            f"PostgreSQL {statistics.median(f['pg']):.1f} us a row",
            flush=True,
        )
        out.append(m)
    return out


if __name__ == "__main__":
    for measured in run(Services.from_env()):
        print(measured.key, round(measured.value, 1), measured.extra)
