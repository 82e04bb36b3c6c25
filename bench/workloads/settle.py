"""What a row's whole life costs PostgreSQL, for each candidate layout of issue #47's settlement.

A row is written, claimed, confirmed, purged and vacuumed. Today each step after the INSERT
writes the row again; the candidates write less. Per candidate and run, ``BLOCK_ROWS`` rows go
through every step in one block (one connection, as one publisher, claims of ``CLAIM_ROWS``),
and per step the CPU of the block's backends (the statements' own cost; the tables'
autovacuum is off, so the block's own ``VACUUM`` carries its dead tuples), the rest of the
server's in the same time (WAL writer, checkpointer, other databases' autovacuum: reported apart,
it is lumpy), WAL bytes and client time are counted:

- ``today``: the product itself: a migrated outbox, ``PublisherStore.claim``, the publisher's
  confirm write-back (``mark_confirmed`` in a unit of work not waiting for the disk, by id),
  ``Retention.purge_confirmed`` and ``VACUUM``;
- ``split``: the row's state in a narrow table of its own beside an immutable message table
  (``bench.profile_narrow``'s statements); the purge deletes from both;
- ``ranges``: the message table is never updated. Each row carries the id of the transaction
  that wrote it (``xid8``); a claim takes the next rows past a cursor in (xid, id) order, only
  from transactions older than every running one (``pg_snapshot_xmin``: no later commit can
  land behind the cursor), and records them as one range row; a confirm settles the range row
  (exceptions would be written per row: none on this path); the purge deletes the settled
  ranges' rows by their key range;
- ``ranges_holes``: ``ranges`` whose claims take every committed row and record the running
  transactions they pass as holes (``pg_snapshot_xip``) rather than wait for them (none runs
  here: the figure is the rule's own cost);
- ``partitions``: ``ranges`` on an outbox partitioned by id, one partition per block: the purge
  drops the partition once its ranges are settled. A unique ``message_id`` cannot span
  partitions in PostgreSQL, so it lives in a table of its own (one more insert and delete).

- ``ranges_product``: the product's own ``RangeStore`` (app/outbox/ranges.py) on its migrated
  outbox: the design's holes, held batches and late claims in full, every row-path index in
  place; the purge by ranges hand-written (not built yet).

``insert`` alone (each candidate's first step) is the floor: the issue's bound for a drained row
(15 us) is set against it. Hand-written SQL for the candidates, the product's calls for today:
``today`` also pays what the product does beyond the happy path (floors, key checks, the WAL
positions a write-back reads).
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from app.db import make_engine
from app.outbox.ranges import RangeStore
from app.outbox.records import Published
from app.outbox.retention import Retention
from app.outbox.store import PublisherStore
from bench.common import REPEATS, Measured, Services, libpq_url, temp_postgres
from bench.proccpu import TICKS, ServiceCpu
from bench.profile_narrow import CLAIM as NARROW_CLAIM
from bench.profile_narrow import DDL as NARROW_DDL
from bench.profile_narrow import INSERT as NARROW_INSERT
from bench.profile_narrow import MESSAGE
from bench.profile_narrow import WRITE_BACK as NARROW_WRITE_BACK

BLOCK_ROWS = 30_000
CLAIM_ROWS = 150
INSERT_ROWS = 5_000  # rows per INSERT statement (a Spark task writes thousands at once)
PURGE_CHUNK = 1_000
BODY = bytes(i % 256 for i in range(256))
STEPS = ("insert", "drain", "purge", "vacuum")
CANDIDATES = ("today", "split", "ranges", "ranges_holes", "partitions", "ranges_product")
ROWS = (
    "SELECT 'm-' || g, 'b-' || (g / 10000), 'ex', 'rk', %(body)s "
    "FROM generate_series(%(first)s::bigint, %(last)s::bigint) g"
)
COLUMNS = "message_id, batch_id, exchange, routing_key, body"
#: The range layouts' message table: the message, the writing transaction, and the columns only
#: an exception writes (never touched on the happy path).
RANGE_TABLE = (
    f"id bigint NOT NULL DEFAULT nextval('r_ids'), {MESSAGE}, "
    "xid xid8 NOT NULL DEFAULT pg_current_xact_id(), exception text"
)
RANGE_DDL = [
    "CREATE SEQUENCE r_ids",
    "CREATE TABLE r_cursor (one boolean PRIMARY KEY DEFAULT true, xid xid8 NOT NULL, "
    "id bigint NOT NULL)",
    "INSERT INTO r_cursor VALUES (true, '0', 0)",
    "CREATE TABLE r_ranges (range_id bigserial PRIMARY KEY, lo_xid xid8 NOT NULL, "
    "lo_id bigint NOT NULL, hi_xid xid8 NOT NULL, hi_id bigint NOT NULL, rows integer NOT NULL, "
    "owner text NOT NULL, lease_until timestamptz NOT NULL, settled_at timestamptz, "
    "holes xid8[] NOT NULL DEFAULT '{}')",
]
#: Lock the cursor (the claims of every publisher take turns on it), then in one statement take
#: the next rows past it from finished transactions only, move it and record the range; return
#: the rows and the range's id. The cursor goes in as values, so the scan starts at it.
RANGE_CURSOR = "SELECT xid, id FROM r_cursor FOR UPDATE"
RANGE_CLAIM = """
WITH picked AS (
  SELECT o.id, o.xid, o.message_id, o.batch_id, o.exchange, o.routing_key, o.mandatory, o.body,
         o.content_type, o.headers::text, o.properties::text, o.ordering_key, o.max_attempts
  FROM {t} o
  WHERE (o.xid, o.id) > (%(cx)s::xid8, %(ci)s::bigint)
    AND o.xid < pg_snapshot_xmin(pg_current_snapshot())
  ORDER BY o.xid, o.id LIMIT %(n)s),
last AS (SELECT xid, id FROM picked ORDER BY xid DESC, id DESC LIMIT 1),
moved AS (UPDATE r_cursor SET xid = last.xid, id = last.id FROM last RETURNING 1),
rng AS (
  INSERT INTO r_ranges (lo_xid, lo_id, hi_xid, hi_id, rows, owner, lease_until)
  SELECT %(cx)s::xid8, %(ci)s::bigint, last.xid, last.id, (SELECT count(*) FROM picked), 'me',
         %(until)s
  FROM last RETURNING range_id)
SELECT picked.*, (SELECT range_id FROM rng), (SELECT count(*) FROM moved) FROM picked
"""
#: ``ranges_holes``: every committed row past the cursor, the running transactions the range
#: spans recorded as its holes (tests/conformance/test_range_claim.py); none run here, so this
#: prices reading the snapshot's xip and the column, not the holes' own later claims.
RANGE_CLAIM_HOLES = (
    RANGE_CLAIM.replace("    AND o.xid < pg_snapshot_xmin(pg_current_snapshot())\n", "")
    .replace(
        "INSERT INTO r_ranges (lo_xid, lo_id, hi_xid, hi_id, rows, owner, lease_until)",
        "INSERT INTO r_ranges (lo_xid, lo_id, hi_xid, hi_id, rows, owner, lease_until, holes)",
    )
    .replace(
        "%(until)s\n",
        "%(until)s, ARRAY(SELECT x FROM pg_snapshot_xip(pg_current_snapshot()) x "
        "WHERE x > %(cx)s::xid8 AND x < last.xid)\n",
    )
)
RANGE_CONFIRM = (
    "UPDATE r_ranges SET settled_at = %(now)s, lease_until = %(now)s WHERE range_id = %(r)s"
)
RANGE_PURGE_ROWS = (
    "DELETE FROM {t} o USING r_ranges r WHERE r.range_id = ANY(%(r)s) "
    "AND (o.xid, o.id) > (r.lo_xid, r.lo_id) AND (o.xid, o.id) <= (r.hi_xid, r.hi_id)"
)
RANGE_PURGE_RANGES = "DELETE FROM r_ranges WHERE range_id = ANY(%(r)s)"
PRODUCT_PURGE_ROWS = (
    "DELETE FROM outbox o USING outbox_ranges r WHERE r.range_id = ANY(%(r)s) "
    "AND r.late_batch IS NULL AND r.late_xid IS NULL AND o.xid IS NOT NULL "
    "AND o.ordering_key IS NULL AND o.stream IS NULL AND o.not_before IS NULL "
    "AND (o.xid, o.id) > (r.lo_xid, r.lo_id) AND (o.xid, o.id) <= (r.hi_xid, r.hi_id)"
)
DDL: dict[str, list[str]] = {
    "split": NARROW_DDL["narrow"],
    "ranges": [
        *RANGE_DDL,
        f"CREATE TABLE r_outbox ({RANGE_TABLE}, PRIMARY KEY (id))",
        "CREATE UNIQUE INDEX ON r_outbox (message_id)",
        "CREATE INDEX ON r_outbox (batch_id)",
        "CREATE INDEX ON r_outbox (xid, id)",
    ],
    "partitions": [
        *RANGE_DDL,
        f"CREATE TABLE p_outbox ({RANGE_TABLE}, PRIMARY KEY (id)) PARTITION BY RANGE (id)",
        "CREATE INDEX ON p_outbox (batch_id)",
        "CREATE INDEX ON p_outbox (xid, id)",
        # a unique message id across partitions: a table of its own
        "CREATE TABLE p_ids (message_id text PRIMARY KEY, id bigint NOT NULL)",
    ],
}
DDL["ranges_holes"] = DDL["ranges"]
TABLES = {
    "today": ["outbox"],
    "split": ["message", "state"],
    "ranges": ["r_outbox", "r_ranges", "r_cursor"],
    "ranges_holes": ["r_outbox", "r_ranges", "r_cursor"],
    "partitions": ["p_outbox", "p_ids", "r_ranges", "r_cursor"],
    "ranges_product": ["outbox", "outbox_ranges", "outbox_range_cursor"],
}


@dataclass
class Block:
    """One candidate's run: per step, PostgreSQL CPU seconds, WAL bytes, client seconds."""

    cpu: dict[str, float] = field(default_factory=dict)
    background: dict[str, float] = field(default_factory=dict)
    wal: dict[str, float] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    claim_ms: list[float] = field(default_factory=list)
    confirm_ms: list[float] = field(default_factory=list)


class Candidate:
    """One layout in its own fresh database: ``insert``, ``claim``/``confirm``, ``purge``."""

    name = ""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = psycopg.connect(libpq_url(url), autocommit=True)
        for statement in DDL.get(self.name, []):
            self.conn.execute(statement)
        for table in TABLES[self.name]:
            if table != "p_outbox":  # a partitioned table has no storage (its partitions do)
                self.conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        self.first = 1

    def close(self) -> None:
        self.conn.close()

    def insert(self, n: int) -> None:
        for start in range(self.first, self.first + n, INSERT_ROWS):
            last = min(start + INSERT_ROWS, self.first + n) - 1
            with self.conn.transaction():
                self._insert(start, last)
        self.first += n

    def _insert(self, first: int, last: int) -> None:
        raise NotImplementedError

    def claim(self) -> Any:
        raise NotImplementedError

    def confirm(self, claimed: Any) -> None:
        raise NotImplementedError

    def purge(self) -> None:
        raise NotImplementedError

    def vacuum(self) -> None:
        self.conn.execute(f"VACUUM {', '.join(TABLES[self.name])}")

    def lsn(self) -> Any:
        return self.conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]

    def wal_since(self, before: Any) -> float:
        row = self.conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (before,))
        return float(row.fetchone()[0])  # type: ignore[index]


class Today(Candidate):
    """The product's own statements on its migrated outbox."""

    name = "today"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.engine = make_engine(url)
        self.store = PublisherStore(self.engine)
        self.retention = Retention(self.engine)
        self.tag = 0

    def close(self) -> None:
        self.engine.dispose()
        super().close()

    def _insert(self, first: int, last: int) -> None:
        values = {"body": BODY, "first": first, "last": last}
        self.conn.execute(f"INSERT INTO outbox ({COLUMNS}) {ROWS}", values)

    def claim(self) -> Any:
        return self.store.claim(owner="me", limit=CLAIM_ROWS, lease_seconds=60)

    def confirm(self, claimed: Any) -> None:
        now = dt.datetime.now(dt.UTC)
        published = []
        for row in claimed:
            self.tag += 1
            published.append(Published(row.id, 1, self.tag, now))
        with self.store.db.unit_of_work(durable=False, by_id=True, positions=True):
            moved = self.store.mark_confirmed(owner="me", published=published)
        assert moved == len(claimed), (moved, len(claimed))

    def purge(self) -> None:
        self.retention.purge_confirmed(older_than=dt.timedelta(0), chunk=PURGE_CHUNK)


class Split(Candidate):
    """The state/message split (``bench.profile_narrow``'s layout ``narrow``)."""

    name = "split"

    def _insert(self, first: int, last: int) -> None:
        self.conn.execute(NARROW_INSERT["narrow"], {"body": BODY, "first": first, "last": last})

    def claim(self) -> Any:
        now = dt.datetime.now(dt.UTC)
        with self.conn.transaction():
            return self.conn.execute(
                NARROW_CLAIM["narrow"].replace("LIMIT 2000", f"LIMIT {CLAIM_ROWS}"),
                {"now": now, "until": now + dt.timedelta(seconds=60)},
            ).fetchall()

    def confirm(self, claimed: Any) -> None:
        ids = [r[0] for r in claimed]
        values = {"now": dt.datetime.now(dt.UTC), "ids": ids, "tags": list(range(len(ids)))}
        with self.conn.transaction():
            self.conn.execute("SET LOCAL synchronous_commit TO off")
            moved = self.conn.execute(NARROW_WRITE_BACK.format(t="state"), values).rowcount
        assert moved == len(ids), (moved, len(ids))

    def purge(self) -> None:
        after = 0
        while True:
            with self.conn.transaction():
                ids = [
                    r[0]
                    for r in self.conn.execute(
                        "DELETE FROM state WHERE id IN (SELECT id FROM state WHERE id > %s "
                        "AND status = 'confirmed' ORDER BY id LIMIT %s) RETURNING id",
                        (after, PURGE_CHUNK),
                    )
                ]
                if not ids:
                    return
                self.conn.execute("DELETE FROM message WHERE id = ANY(%s)", (ids,))
            after = max(ids)


class Ranges(Candidate):
    """Claims as ranges in a small table; rows written once."""

    name = "ranges"
    table = "r_outbox"
    claim_sql = RANGE_CLAIM

    def _insert(self, first: int, last: int) -> None:
        values = {"body": BODY, "first": first, "last": last}
        self.conn.execute(f"INSERT INTO {self.table} ({COLUMNS}) {ROWS}", values)

    def claim(self) -> Any:
        now = dt.datetime.now(dt.UTC)
        with self.conn.transaction():
            cx, ci = self.conn.execute(RANGE_CURSOR).fetchone()  # type: ignore[misc]
            values = {"n": CLAIM_ROWS, "until": now + dt.timedelta(seconds=60), "cx": cx, "ci": ci}
            return self.conn.execute(self.claim_sql.format(t=self.table), values).fetchall()

    def confirm(self, claimed: Any) -> None:
        with self.conn.transaction():
            self.conn.execute("SET LOCAL synchronous_commit TO off")
            values = {"now": dt.datetime.now(dt.UTC), "r": claimed[0][-2]}
            assert self.conn.execute(RANGE_CONFIRM, values).rowcount == 1

    def _settled(self) -> list[tuple[int, int]]:
        return self.conn.execute(
            "SELECT range_id, rows FROM r_ranges WHERE settled_at IS NOT NULL ORDER BY range_id"
        ).fetchall()

    def purge(self) -> None:
        settled = self._settled()
        chunk: list[int] = []
        rows = 0
        for i, (range_id, n) in enumerate(settled):
            chunk.append(range_id)
            rows += n
            if rows >= PURGE_CHUNK or i == len(settled) - 1:
                with self.conn.transaction():
                    self.conn.execute(RANGE_PURGE_ROWS.format(t=self.table), {"r": chunk})
                    self.conn.execute(RANGE_PURGE_RANGES, {"r": chunk})
                chunk, rows = [], 0


class RangesHoles(Ranges):
    """``Ranges`` whose claims record running transactions as holes instead of waiting for them."""

    name = "ranges_holes"
    claim_sql = RANGE_CLAIM_HOLES


class Partitions(Ranges):
    """``Ranges`` on an outbox partitioned by id; the purge drops a settled partition."""

    name = "partitions"
    table = "p_outbox"

    def insert(self, n: int) -> None:
        # the block's partition is made beforehand (a real outbox keeps a few ahead)
        part = f"p_outbox_{self.first}"
        self.conn.execute(
            f"CREATE TABLE {part} PARTITION OF p_outbox FOR VALUES FROM ({self.first}) "
            f"TO ({self.first + n})"
        )
        self.conn.execute(f"ALTER TABLE {part} SET (autovacuum_enabled = false)")
        self.conn.execute(f"SELECT setval('r_ids', {self.first}, false)")
        self.part = part
        super().insert(n)

    def _insert(self, first: int, last: int) -> None:
        values = {"body": BODY, "first": first, "last": last}
        self.conn.execute(
            f"WITH m AS (INSERT INTO p_outbox ({COLUMNS}) {ROWS} RETURNING id, message_id) "
            "INSERT INTO p_ids (message_id, id) SELECT message_id, id FROM m",
            values,
        )

    def purge(self) -> None:
        settled = self._settled()
        assert sum(n for _, n in settled) == BLOCK_ROWS, "every range of the block settled"
        with self.conn.transaction():
            # the ids of the partition's messages go (chunked as the other purges)
            last = 0
            while True:
                gone = self.conn.execute(
                    "DELETE FROM p_ids WHERE message_id IN (SELECT message_id FROM p_ids "
                    "WHERE id > %s ORDER BY id LIMIT %s) RETURNING id",
                    (last, PURGE_CHUNK),
                ).fetchall()
                if not gone:
                    break
                last = max(r[0] for r in gone)
            self.conn.execute(f"ALTER TABLE p_outbox DETACH PARTITION {self.part}")
            self.conn.execute(f"DROP TABLE {self.part}")
            self.conn.execute(RANGE_PURGE_RANGES, {"r": [r for r, _ in settled]})


class RangesProduct(Today):
    """The product's own range settlement (``app.outbox.ranges.RangeStore``, migration 0023) on
    its migrated outbox, every row-path index still in place: ``RangeStore.claim`` (holes, held
    batches, late claims), the settle in a write-back's unit of work not waiting for the disk.
    The purge is hand-written (retention by ranges is not built yet): a settled range's members
    deleted by its interval, then the range."""

    name = "ranges_product"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ranges = RangeStore(self.engine)

    def claim(self) -> Any:
        claims = self.ranges.claim(owner="me", limit=CLAIM_ROWS, lease_seconds=60)
        return [c.range_id for c in claims for _ in c.rows]  # one entry a row (the drain counts)

    def confirm(self, claimed: Any) -> None:
        ranges = sorted(set(claimed))
        with self.ranges.db.unit_of_work(durable=False, positions=True):
            settled = self.ranges.settle(owner="me", range_ids=ranges)
        assert settled == len(ranges), (settled, ranges)

    def purge(self) -> None:
        while True:
            with self.conn.transaction():
                chunk = [
                    r[0]
                    for r in self.conn.execute(
                        "SELECT range_id FROM outbox_ranges WHERE settled_at IS NOT NULL "
                        "ORDER BY range_id LIMIT %s",
                        (max(1, PURGE_CHUNK // CLAIM_ROWS),),
                    )
                ]
                if not chunk:
                    return
                self.conn.execute(PRODUCT_PURGE_ROWS, {"r": chunk})
                self.conn.execute(
                    "DELETE FROM outbox_ranges WHERE range_id = ANY(%(r)s)", {"r": chunk}
                )


KINDS: dict[str, Callable[[str], Candidate]] = {
    "today": Today,
    "split": Split,
    "ranges": Ranges,
    "ranges_holes": RangesHoles,
    "partitions": Partitions,
    "ranges_product": RangesProduct,
}


def _backend_cpu(candidate: Candidate) -> dict[int, float]:
    """CPU seconds so far of each backend connected to the candidate's database (its own
    connection, and the product's pool for ``today``), from ``/proc``."""
    pids = candidate.conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
    ).fetchall()
    out = {}
    for (pid,) in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        out[pid] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def _block(candidate: Candidate, cpu: ServiceCpu) -> Block:
    """One block of ``BLOCK_ROWS`` rows through every step; each step measured alone: its
    backends' CPU (the statements' own cost), and the whole server's (with the WAL writer,
    the checkpointer and any other database's autovacuum: ``background`` is the difference)."""
    out = Block()

    def measured(step: str, fn: Callable[[], None]) -> None:
        before = candidate.lsn()
        backends = _backend_cpu(candidate)
        cpu.start()
        began = time.perf_counter()
        fn()
        out.wall[step] = out.wall.get(step, 0.0) + time.perf_counter() - began
        server = cpu.stop()["postgresql"]
        after = _backend_cpu(candidate)
        spent = sum(t - backends.get(pid, 0.0) for pid, t in after.items())
        out.cpu[step] = out.cpu.get(step, 0.0) + spent
        out.background[step] = out.background.get(step, 0.0) + max(0.0, server - spent)
        out.wal[step] = out.wal.get(step, 0.0) + candidate.wal_since(before)

    measured("insert", lambda: candidate.insert(BLOCK_ROWS))
    # as autovacuum would have by now (with no statistics the split's write-back scans its
    # whole table); not counted: every candidate needs it alike
    candidate.conn.execute(f"ANALYZE {', '.join(TABLES[candidate.name])}")

    def drain() -> None:
        """As a publisher drains: a claim, then the confirms of the one before it (a window of
        two claims), until the block is confirmed."""
        outstanding: list[Any] = []
        taken = 0
        while taken < BLOCK_ROWS or outstanding:
            if taken < BLOCK_ROWS:
                began = time.perf_counter()
                claimed = candidate.claim()
                out.claim_ms.append((time.perf_counter() - began) * 1e3)
                if not claimed:
                    raise RuntimeError(f"{candidate.name}: a claim found nothing at {taken} rows")
                taken += len(claimed)
                outstanding.append(claimed)
            if len(outstanding) > 1 or taken >= BLOCK_ROWS:
                began = time.perf_counter()
                candidate.confirm(outstanding.pop(0))
                out.confirm_ms.append((time.perf_counter() - began) * 1e3)

    measured("drain", drain)
    measured("purge", candidate.purge)
    measured("vacuum", candidate.vacuum)
    return out


def run(services: Services, sizes: Any = None) -> list[Measured]:
    """Each candidate in a database of its own; the candidates' blocks in turn, ``REPEATS``
    rounds (a slow minute of the machine falls on all alike), after one untimed warm-up block
    each."""
    blocks: dict[str, list[Block]] = {name: [] for name in CANDIDATES}
    cpu = ServiceCpu(postgresql=services.database_port)
    with (
        temp_postgres(services) as u1,
        temp_postgres(services) as u2,
        temp_postgres(services) as u3,
        temp_postgres(services) as u4,
        temp_postgres(services) as u5,
        temp_postgres(services) as u6,
    ):
        urls = (u1, u2, u3, u4, u5, u6)
        candidates = [KINDS[name](url) for name, url in zip(CANDIDATES, urls, strict=True)]
        try:
            for candidate in candidates:
                _block(candidate, cpu)  # warm-up
            for i in range(REPEATS):
                k = i % len(candidates)  # each candidate first as often as the others
                for candidate in candidates[k:] + candidates[:k]:
                    blocks[candidate.name].append(_block(candidate, cpu))
        finally:
            for candidate in candidates:
                candidate.close()
    return [_measured(name, runs) for name, runs in blocks.items()]


def _measured(name: str, runs: list[Block]) -> Measured:
    per_row = [sum(b.cpu.values()) / BLOCK_ROWS * 1e6 for b in runs]
    extra: dict[str, Any] = {
        "rows": BLOCK_ROWS,
        "claim_rows": CLAIM_ROWS,
        "wal_bytes_per_row": [round(sum(b.wal.values()) / BLOCK_ROWS) for b in runs],
        "background_pg_us_per_row": [
            round(sum(b.background.values()) / BLOCK_ROWS * 1e6, 2) for b in runs
        ],
        "claim_ms_median": [round(statistics.median(b.claim_ms), 3) for b in runs],
        "confirm_ms_median": [round(statistics.median(b.confirm_ms), 3) for b in runs],
    }
    for step in STEPS:
        extra[f"{step}_pg_us_per_row"] = [round(b.cpu[step] / BLOCK_ROWS * 1e6, 2) for b in runs]
        extra[f"{step}_wal_bytes_per_row"] = [round(b.wal[step] / BLOCK_ROWS) for b in runs]
        extra[f"{step}_wall_us_per_row"] = [round(b.wall[step] / BLOCK_ROWS * 1e6, 2) for b in runs]
    m = Measured(key=f"settle_{name}_pg_us_per_row", unit="us", runs=per_row, extra=extra)
    steps = ", ".join(f"{s} {statistics.median(extra[f'{s}_pg_us_per_row']):.1f}" for s in STEPS)
    print(
        f"  {name}: PostgreSQL {m.value:.1f} us a row ({steps}); WAL "
        f"{statistics.median(extra['wal_bytes_per_row'])} B a row; the rest of the server "
        f"{statistics.median(extra['background_pg_us_per_row']):.1f} us a row; claim "
        f"{statistics.median(extra['claim_ms_median']):.2f} ms, confirm "
        f"{statistics.median(extra['confirm_ms_median']):.2f} ms",
        flush=True,
    )
    return m


if __name__ == "__main__":
    for measured in run(Services.from_env()):
        print(measured.key, round(measured.value, 2), measured.extra)
