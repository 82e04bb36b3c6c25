"""Would narrower row versions make a row's two writes cheaper? ``python -m bench.profile_narrow``.

Every claim and every write-back gives each row a new version, body and all, with an entry in
every index whose predicate the row meets (a change of ``status``, which the partial indexes
name, is never a HOT update). This measures the alternative the schema could take: the row's
state in its own narrow table beside an immutable message table. In a fresh PostgreSQL database
(the local services' server), two layouts with the outbox's columns and the indexes a row meets
on its way pending → in_flight → confirmed:

- ``wide``: one table, as the outbox is (primary key, unique ``message_id``, batch, the partial
  due, lease and lost-confirm indexes);
- ``narrow``: ``message`` (primary key, unique ``message_id``, batch) and ``state`` (primary key,
  due, lease, lost-confirm), one row each per message;
- ``brin`` (``--layouts wide,brin``): ``wide`` with the outbox's BRIN index on ``created_at``
  (``ix_outbox_created``, migration 0018), to price that index alone.

Each cycle inserts ``--rows`` rows (one statement, as a Spark task's COPY is one), claims them
(the product's claim shape: ``FOR UPDATE SKIP LOCKED`` in a CTE, ``UPDATE … RETURNING`` the
message; the narrow one joins the message table) and writes their confirms back (``UPDATE …
FROM unnest(…)``, commit not waiting for the disk, as the publisher's write-backs). The layouts
alternate cycle by cycle; every table is vacuumed and analysed every 50 cycles, so that their
plans stay alike and row versions land on reused pages, as under autovacuum (a BRIN range is
only summarised, and from then on kept up to date by every new version in it, once vacuumed).
Prints each step's median and p90 time and WAL bytes per row. Hand-written SQL on both sides
(not the product's statements), so only the difference between the two lines means anything.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from typing import Any

import psycopg

from bench.common import Services, libpq_url, temp_postgres

MESSAGE = (
    "message_id text NOT NULL, batch_id text NOT NULL, exchange text NOT NULL, "
    "routing_key text NOT NULL, mandatory boolean NOT NULL DEFAULT true, body bytea NOT NULL, "
    "content_type text, headers json, properties json, ordering_key text, "
    "max_attempts integer NOT NULL DEFAULT 10, created_at timestamptz NOT NULL DEFAULT now()"
)
STATE = (
    "status text NOT NULL DEFAULT 'pending', available_at timestamptz NOT NULL DEFAULT now(), "
    "attempts integer NOT NULL DEFAULT 0, lease_owner text, lease_until timestamptz, "
    "claimed_at timestamptz, channel_id integer, delivery_tag bigint, published_at timestamptz, "
    "confirmed_at timestamptz, last_error text, lost_confirms integer NOT NULL DEFAULT 0"
)
STATE_INDEXES = [
    "CREATE INDEX ON {t} (available_at, id) WHERE status = 'pending'",
    "CREATE INDEX ON {t} (lease_until) WHERE status = 'in_flight'",
    "CREATE INDEX ON {t} (id) WHERE lost_confirms > 0",
]
DDL = {
    "wide": [
        f"CREATE TABLE wide (id bigserial PRIMARY KEY, {MESSAGE}, {STATE})",
        "CREATE UNIQUE INDEX ON wide (message_id)",
        "CREATE INDEX ON wide (batch_id)",
        *(s.format(t="wide") for s in STATE_INDEXES),
    ],
    "narrow": [
        f"CREATE TABLE message (id bigserial PRIMARY KEY, {MESSAGE})",
        "CREATE UNIQUE INDEX ON message (message_id)",
        "CREATE INDEX ON message (batch_id)",
        f"CREATE TABLE state (id bigint PRIMARY KEY, {STATE})",
        *(s.format(t="state") for s in STATE_INDEXES),
    ],
}
DDL["brin"] = [
    *(s.replace("wide", "brin") for s in DDL["wide"]),
    "CREATE INDEX ON brin USING brin (created_at)",
]
TABLES = {"wide": ["wide"], "narrow": ["message", "state"], "brin": ["brin"]}
ROWS = (
    "SELECT 'm-' || g, 'b', 'ex', 'rk', %(body)s "
    "FROM generate_series(%(first)s::bigint, %(last)s::bigint) g"
)
INSERT = {
    "wide": f"INSERT INTO wide (message_id, batch_id, exchange, routing_key, body) {ROWS}",
    "brin": f"INSERT INTO brin (message_id, batch_id, exchange, routing_key, body) {ROWS}",
    "narrow": (
        f"WITH m AS (INSERT INTO message (message_id, batch_id, exchange, routing_key, body) "
        f"{ROWS} RETURNING id) INSERT INTO state (id) SELECT id FROM m"
    ),
}
RETURNING = (
    "m.id, m.message_id, m.batch_id, m.exchange, m.routing_key, m.mandatory, m.body, "
    "m.content_type, m.headers::text, m.properties::text, m.ordering_key, {s}.attempts, "
    "m.max_attempts"
)
SET_CLAIMED = (
    "SET status = 'in_flight', attempts = {s}.attempts + 1, lease_owner = 'me', "
    "lease_until = %(until)s, claimed_at = %(now)s"
)
DUE = (
    "WITH due AS (SELECT id FROM {t} WHERE status = 'pending' AND available_at <= %(now)s "
    "ORDER BY available_at, id LIMIT 2000 FOR UPDATE SKIP LOCKED) "
)
CLAIM = {
    **{
        t: DUE.format(t=t)
        + f"UPDATE {t} m "
        + SET_CLAIMED.format(s="m")
        + " FROM due WHERE m.id = due.id RETURNING "
        + RETURNING.format(s="m")
        for t in ("wide", "brin")
    },
    "narrow": DUE.format(t="state")
    + "UPDATE state s "
    + SET_CLAIMED.format(s="s")
    + " FROM due, message m WHERE s.id = due.id AND m.id = s.id RETURNING "
    + RETURNING.format(s="s"),
}
WRITE_BACK = (
    "UPDATE {t} SET status = 'confirmed', lease_owner = NULL, lease_until = NULL, "
    "channel_id = 1, delivery_tag = v.tag, published_at = %(now)s, confirmed_at = %(now)s "
    "FROM (SELECT unnest(%(ids)s::bigint[]) AS id, unnest(%(tags)s::bigint[]) AS tag) AS v "
    "WHERE {t}.id = v.id AND {t}.status = 'in_flight' AND {t}.lease_owner = 'me'"
)
UPDATED = {"wide": "wide", "narrow": "state", "brin": "brin"}
STEPS = ("insert", "claim", "write-back")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300, help="cycles per layout")
    parser.add_argument("--rows", type=int, default=170, help="rows per cycle (a claim's size)")
    parser.add_argument("--body", type=int, default=256, help="body bytes per row")
    parser.add_argument(
        "--layouts", default="wide,narrow", help="two or more of wide, narrow, brin"
    )
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    if len(layouts) < 2 or not set(layouts) <= set(DDL) or len(set(layouts)) != len(layouts):
        parser.error(f"--layouts: two or more of {', '.join(DDL)}, each once")
    tables = ", ".join(t for layout in layouts for t in TABLES[layout])
    n, body = args.rows, bytes(i % 256 for i in range(args.body))
    times: dict[tuple[str, str], list[float]] = {}
    wal: dict[tuple[str, str], list[float]] = {}
    with (
        temp_postgres(Services.from_env()) as url,
        psycopg.connect(libpq_url(url), autocommit=True) as conn,
    ):
        for layout in layouts:
            for statement in DDL[layout]:
                conn.execute(statement)

        def lsn() -> Any:
            return conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]

        def step(layout: str, name: str, run: Any) -> Any:
            before, start = lsn(), time.perf_counter()
            result = run()
            times.setdefault((layout, name), []).append(time.perf_counter() - start)
            done = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (before,))
            wal.setdefault((layout, name), []).append(done.fetchone()[0] / n)  # type: ignore[index]
            return result

        first = 0
        for cycle in range(args.cycles):
            if cycle % 50 == 0:
                conn.execute(f"VACUUM ANALYZE {tables}")
            k = cycle % len(layouts)  # each layout first as often as the others
            for layout in layouts[k:] + layouts[:k]:
                values = {"body": body, "first": first, "last": first + n - 1}

                def insert(layout: str = layout, values: dict[str, Any] = values) -> None:
                    with conn.transaction():
                        conn.execute(INSERT[layout], values)

                def claim(layout: str = layout) -> list[Any]:
                    now = dt.datetime.now(dt.UTC)
                    times_ = {"now": now, "until": now + dt.timedelta(seconds=60)}
                    with conn.transaction():
                        return conn.execute(CLAIM[layout], times_).fetchall()

                def write_back(ids: list[int], layout: str = layout) -> None:
                    values = {
                        "now": dt.datetime.now(dt.UTC),
                        "ids": ids,
                        "tags": list(range(1, len(ids) + 1)),
                    }
                    with conn.transaction():
                        conn.execute("SET LOCAL synchronous_commit TO off")
                        moved = conn.execute(WRITE_BACK.format(t=UPDATED[layout]), values)
                        assert moved.rowcount == len(ids), (moved.rowcount, len(ids))

                step(layout, "insert", insert)
                rows = step(layout, "claim", claim)
                assert len(rows) == n, (layout, len(rows))
                step(layout, "write-back", lambda rows=rows: write_back([r[0] for r in rows]))
            first += n
    skip = min(20, args.cycles // 5)  # the first cycles warm caches
    print(f"{args.cycles} cycles of {n} rows ({args.body}-byte bodies) per layout")
    print(f"{'step':<11} {'layout':<7} {'median ms':>9} {'p90 ms':>7} {'WAL B/row':>9}")
    for name in STEPS:
        for layout in layouts:
            t = sorted(times[(layout, name)][skip:])
            w = statistics.median(wal[(layout, name)][skip:])
            print(
                f"{name:<11} {layout:<7} {statistics.median(t) * 1e3:9.2f} "
                f"{t[int(len(t) * 0.9)] * 1e3:7.2f} {w:9.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
