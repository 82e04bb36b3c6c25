"""Settlement by ranges (issue 47; docs/architecture.md, "Settlement by ranges"), PostgreSQL.

A claim takes the next range-shaped rows past one cursor in ``(xid, id)`` order and records
them as ONE row of ``outbox_ranges``, leased; its rows are never rewritten on the happy path: a
confirm of all of them settles the range (one write), and a row's status is derived from its
range. The rules, each proven over generated schedules (tests/conformance/test_range_claim.py on
the design's own tables, tests/conformance/test_range_store.py on this module):

- **Commit order, with holes.** A claim takes every committed row past the cursor and records
  in its range the transactions still running that its interval spans (``holes``); once a
  claim's snapshot sees one has ended, its rows (behind the cursor) are claimed as a range of
  their own (``late_xid``). An open transaction holds back only its own rows.
- **Parked rows** (``format("outbox")``: ``available_at`` = the parked time) are no range's
  members; the Spark writer's release re-stamps their ``xid`` (spark_writer/db.py), so they come
  through the cursor after it commits.
- **Held batches** (``outbox_held``): a claim passes their rows and records the batch in its
  range (``skipped``); once the hold is lifted, the next claim, under the cursor's lock, takes
  the rows those ranges skipped as a range of its own (``late_batch``, covering the skipping
  ranges ``lo_id`` to ``hi_id``: a batch held again later is late-claimed again, apart).
- **Members never change after the claim.** A range's members are the range-shaped, unparked
  rows of its domain (its interval less its holes and skipped batches; a hole's transaction; a
  late batch's rows in the ranges it covers), whatever their ``row_path`` or ``status``. The
  claim publishes the members the row path does not own and that are due, and hands a member
  not due yet to the row path (``row_path = true``, pending: its one rewrite). The shape columns
  are fixed at INSERT (migration 0023's trigger).
- **Exceptions** (a nack, a return, a failure, a release back to pending, a resend): the
  publisher first :meth:`RangeStore.adopt` s the member, which the row path then owns
  (``row_path = true``, ``in_flight`` under the range's lease), and writes the outcome on the
  row as today. A range settles once each member is acked or adopted.
- **A lease that expires** (the publisher died): :meth:`RangeStore.expire` hands each member
  the row path does not own yet to it, pending and counted as a possible duplicate
  (``lost_confirms + 1``), and closes the range.

A row's status (:meth:`RangeStore.statuses`): its own once the row path owns it (``row_path``,
or not range-shaped, or parked); else ``confirmed`` as a member of a settled range, ``in_flight``
of a leased one; else its own (``pending``: nothing wrote it; and exact for rows a publisher
settling rows, before ranges, settled on the row itself).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine

from app.outbox.database import OutboxDatabase
from app.outbox.records import ClaimedRow
from spark_writer.envelope import PARKED

#: A row a range may hold (ix_outbox_range's predicate, app/outbox/schema.py RANGE_SHAPE).
SHAPE = "o.xid IS NOT NULL AND o.ordering_key IS NULL AND o.stream IS NULL AND o.not_before IS NULL"
UNPARKED = f"o.available_at <> '{PARKED}+00'"
#: The columns a publish needs, read in the window's own scan (ClaimedRow's order).
ROW = (
    "o.id, o.message_id, o.batch_id, o.exchange, o.routing_key, o.mandatory, o.body, "
    "o.content_type, o.headers::text AS headers, o.properties::text AS properties, "
    "o.ordering_key, o.attempts + 1 AS attempts, o.max_attempts"
)
PICKED = (
    "id, message_id, batch_id, exchange, routing_key, mandatory, body, content_type, headers, "
    "properties, ordering_key, attempts, max_attempts"
)
#: Locks the cursor; and gives the planner back its choices, which the row path's claim earlier
#: in the same transaction may have narrowed to its index walk (app/outbox/planner.py): the
#: window's sort, the snapshot's scans and the late claims' joins need them. By its key: planned
#: with sequential scans off, a scan of the one-row table cost 1e10 and was compiled by the JIT
#: (150 ms).
CURSOR = (
    "SELECT xid::text, id, set_config('enable_bitmapscan', 'on', true) || "
    "set_config('enable_seqscan', 'on', true) || set_config('enable_sort', 'on', true) "
    "FROM outbox_range_cursor WHERE one FOR UPDATE"
)
#: The tail of every claim: of the window's rows (its members) publish those the row path does
#: not own and that are due; hand a member not due yet to the row path in the same statement.
PUBLISH = f"""
passed AS (
  UPDATE outbox o SET row_path = true FROM win
  WHERE o.id = win.id AND NOT win.due AND NOT win.row_path RETURNING 1),
picked AS (SELECT {PICKED} FROM win WHERE win.due AND NOT win.row_path)"""
LEASE = "%(owner)s, %(until)s, %(now)s"
HELD = "SELECT batch_id FROM outbox_held"
#: The cursor's next rows, as one range.
CLAIM = f"""
WITH win AS (
  SELECT {ROW}, o.xid, o.available_at <= %(now)s AS due, o.row_path FROM outbox o
  WHERE (o.xid, o.id) > (%(cx)s::xid8, %(ci)s::bigint) AND {SHAPE} AND {UNPARKED}
    AND o.batch_id NOT IN ({HELD})
  ORDER BY o.xid, o.id LIMIT %(n)s),
{PUBLISH},
last AS (SELECT xid, id FROM win ORDER BY xid DESC, id DESC LIMIT 1),
moved AS (UPDATE outbox_range_cursor SET xid = last.xid, id = last.id FROM last RETURNING 1),
rng AS (
  INSERT INTO outbox_ranges (lo_xid, lo_id, hi_xid, hi_id, rows, owner, lease_until,
                             claimed_at, skipped, holes)
  SELECT %(cx)s::xid8, %(ci)s::bigint, last.xid, last.id, (SELECT count(*) FROM picked),
         {LEASE},
         CASE WHEN EXISTS ({HELD}) THEN ARRAY(
           SELECT DISTINCT o.batch_id FROM outbox o
           WHERE (o.xid, o.id) > (%(cx)s::xid8, %(ci)s::bigint)
             AND (o.xid, o.id) <= (last.xid, last.id) AND {SHAPE} AND {UNPARKED}
             AND o.batch_id IN ({HELD})) ELSE '{{}}' END,
         ARRAY(SELECT x FROM pg_snapshot_xip(pg_current_snapshot()) x
               WHERE x > %(cx)s::xid8 AND x < last.xid)
  FROM last RETURNING range_id)
SELECT (SELECT range_id FROM rng), (SELECT count(*) FROM moved), {PICKED} FROM picked
UNION ALL
SELECT (SELECT range_id FROM rng), (SELECT count(*) FROM moved), {", ".join(["NULL"] * 13)}
WHERE NOT EXISTS (SELECT 1 FROM picked) AND (SELECT count(*) FROM passed) >= 0
"""
#: Holes whose transaction has ended (seen by this snapshot), not claimed yet.
ENDED = """
SELECT DISTINCT h::text FROM outbox_ranges r, unnest(r.holes) h
WHERE r.holes <> '{}' AND pg_visible_in_snapshot(h, pg_current_snapshot())
  AND NOT EXISTS (SELECT 1 FROM outbox_ranges l WHERE l.late_xid = h)
ORDER BY 1
"""
#: An ended hole's rows (all behind the cursor), as a range of their own.
HOLE_CLAIM = f"""
WITH win AS (
  SELECT {ROW}, o.xid, o.available_at <= %(now)s AS due, o.row_path FROM outbox o
  WHERE o.xid = %(h)s::xid8 AND {SHAPE} AND {UNPARKED} AND o.batch_id NOT IN ({HELD})),
{PUBLISH},
rng AS (
  INSERT INTO outbox_ranges (rows, late_xid, owner, lease_until, claimed_at, skipped)
  VALUES ((SELECT count(*) FROM picked), %(h)s::xid8, {LEASE},
          ARRAY(SELECT DISTINCT o.batch_id FROM outbox o WHERE o.xid = %(h)s::xid8
                AND {SHAPE} AND {UNPARKED} AND o.batch_id IN ({HELD})))
  RETURNING range_id)
SELECT (SELECT range_id FROM rng), (SELECT count(*) FROM passed), {PICKED} FROM picked
UNION ALL
SELECT (SELECT range_id FROM rng), 0, {", ".join(["NULL"] * 13)}
WHERE NOT EXISTS (SELECT 1 FROM picked)
"""
#: Where a range ``r``'s rows are: its interval less its holes, or its hole's transaction.
DOMAIN = (
    "((r.late_batch IS NULL AND r.late_xid IS NULL AND (o.xid, o.id) > (r.lo_xid, r.lo_id) "
    "AND (o.xid, o.id) <= (r.hi_xid, r.hi_id) AND NOT (o.xid = ANY(r.holes))) "
    "OR (r.late_xid IS NOT NULL AND o.xid = r.late_xid))"
)
#: Batches whose hold was lifted after ranges skipped them, with the first and last of those
#: ranges that no late range covers yet.
LIFTED = f"""
SELECT b, min(r.range_id), max(r.range_id) FROM outbox_ranges r, unnest(r.skipped) b
WHERE r.skipped <> '{{}}' AND b NOT IN ({HELD})
  AND NOT EXISTS (SELECT 1 FROM outbox_ranges l WHERE l.late_batch = b
                  AND r.range_id BETWEEN l.lo_id AND l.hi_id)
GROUP BY b ORDER BY b
"""
#: A lifted batch's rows those ranges skipped, as a range of their own.
LATE_CLAIM = f"""
WITH win AS (
  SELECT DISTINCT {ROW}, o.xid, o.available_at <= %(now)s AS due, o.row_path
  FROM outbox o JOIN outbox_ranges r ON %(b)s = ANY(r.skipped)
    AND r.range_id BETWEEN %(lo)s AND %(hi)s AND {DOMAIN}
  WHERE o.batch_id = %(b)s AND {SHAPE} AND {UNPARKED}),
{PUBLISH},
rng AS (
  INSERT INTO outbox_ranges (rows, late_batch, lo_id, hi_id, owner, lease_until, claimed_at)
  VALUES ((SELECT count(*) FROM picked), %(b)s, %(lo)s, %(hi)s, {LEASE}) RETURNING range_id)
SELECT (SELECT range_id FROM rng), (SELECT count(*) FROM passed), {PICKED} FROM picked
UNION ALL
SELECT (SELECT range_id FROM rng), 0, {", ".join(["NULL"] * 13)}
WHERE NOT EXISTS (SELECT 1 FROM picked)
"""
#: The members of the ranges given (``%(ranges)s``): ``(range_id, row id)``.
MEMBERS = f"""
SELECT r.range_id, o.id FROM outbox_ranges r JOIN outbox o ON {DOMAIN}
WHERE r.range_id = ANY(%(ranges)s) AND {SHAPE} AND {UNPARKED}
  AND NOT (o.batch_id = ANY(r.skipped))
UNION ALL
SELECT l.range_id, o.id FROM outbox_ranges l
  JOIN outbox_ranges r ON l.late_batch = ANY(r.skipped) AND r.range_id BETWEEN l.lo_id AND l.hi_id
  JOIN outbox o ON o.batch_id = l.late_batch AND {DOMAIN}
WHERE l.range_id = ANY(%(ranges)s) AND {SHAPE} AND {UNPARKED}
"""
#: A settled range keeps its owner (a closed one, ``expire``'s, has none): a settle retried
#: because its COMMIT's reply was lost finds the range settled by its owner, and says so.
SETTLE = """
WITH s AS (
  UPDATE outbox_ranges SET settled_at = %(now)s, lease_until = NULL
  WHERE range_id = ANY(%(ranges)s) AND owner = %(owner)s AND settled_at IS NULL
  RETURNING range_id)
SELECT range_id FROM s
UNION
SELECT range_id FROM outbox_ranges
WHERE range_id = ANY(%(ranges)s) AND owner = %(owner)s AND settled_at IS NOT NULL
"""
LEASED = """
SELECT range_id FROM outbox_ranges
WHERE range_id = ANY(%(ranges)s) AND owner = %(owner)s AND settled_at IS NULL
"""
RENEW = """
UPDATE outbox_ranges SET lease_until = %(until)s
WHERE range_id = ANY(%(ranges)s) AND owner = %(owner)s AND settled_at IS NULL
"""
#: Members handed to the row path, in flight under the range's lease (before any outcome other
#: than a confirm is written on them as on any row).
ADOPT = f"""
UPDATE outbox o SET row_path = true, status = 'in_flight', lease_owner = r.owner,
       lease_until = r.lease_until, claimed_at = r.claimed_at, attempts = o.attempts + 1
FROM outbox_ranges r
WHERE r.range_id = %(range)s AND r.owner = %(owner)s AND r.settled_at IS NULL
  AND o.id = ANY(%(ids)s) AND NOT o.row_path AND o.status = 'pending'
  AND o.id IN (SELECT m.id FROM ({MEMBERS.replace("%(ranges)s", "ARRAY[%(range)s]::bigint[]")})
               AS m(range_id, id))
RETURNING o.id
"""
EXPIRED = """
SELECT range_id FROM outbox_ranges
WHERE settled_at IS NULL AND lease_until < %(now)s ORDER BY range_id FOR UPDATE SKIP LOCKED
"""
#: Ranges leased to ``owner`` that it does not hold (the claimer's orphan check).
ORPHANED = """
SELECT range_id FROM outbox_ranges
WHERE settled_at IS NULL AND owner = %(owner)s AND NOT (range_id = ANY(%(keep)s))
ORDER BY range_id FOR UPDATE SKIP LOCKED
"""
#: An expired range's members the row path does not own yet: pending again, possible
#: duplicates (their publish may have reached the broker); then the range is closed.
EXPIRE = f"""
WITH m AS ({MEMBERS}),
handed AS (
  UPDATE outbox o SET row_path = true,
         lost_confirms = o.lost_confirms + CASE WHEN %(counted)s THEN 1 ELSE 0 END,
         available_at = %(now)s
  FROM m WHERE o.id = m.id AND NOT o.row_path AND o.status = 'pending' RETURNING 1),
closed AS (
  UPDATE outbox_ranges SET settled_at = %(now)s, owner = NULL, lease_until = NULL
  WHERE range_id = ANY(%(ranges)s) RETURNING 1)
SELECT (SELECT count(*) FROM handed), (SELECT count(*) FROM closed)
"""
#: Each row's range, as the read views derive a status: the interval range holding its
#: ``(xid, id)``; the hole range if it is in that range's holes; the late range if its batch
#: was skipped there.
#: Each row's status as a reader derives it, and who holds it when in flight (the row's lease
#: owner, or its range's); ``{where}`` narrows the rows (``o``).
DERIVED = f"""
SELECT o.id, o.message_id,
  CASE WHEN o.row_path OR NOT ({SHAPE}) OR NOT ({UNPARKED}) THEN o.status
       WHEN fin.range_id IS NULL THEN o.status
       WHEN fin.settled_at IS NOT NULL THEN 'confirmed'
       ELSE 'in_flight' END AS status,
  CASE WHEN o.row_path OR NOT ({SHAPE}) OR NOT ({UNPARKED}) OR fin.range_id IS NULL
       THEN o.lease_owner ELSE fin.owner END AS owner
FROM outbox o
LEFT JOIN LATERAL (
  SELECT r.range_id, r.settled_at, r.owner, r.skipped, o.xid = ANY(r.holes) AS in_hole
  FROM outbox_ranges r
  WHERE r.late_batch IS NULL AND r.late_xid IS NULL
    AND (r.hi_xid, r.hi_id) >= (o.xid, o.id) AND (r.lo_xid, r.lo_id) < (o.xid, o.id)
  ORDER BY r.hi_xid, r.hi_id LIMIT 1) iv ON true
LEFT JOIN outbox_ranges hx ON iv.in_hole AND hx.late_xid = o.xid
LEFT JOIN LATERAL (
  SELECT p.range_id, p.settled_at, p.owner, p.skipped FROM (
    SELECT iv.range_id, iv.settled_at, iv.owner, iv.skipped WHERE NOT iv.in_hole
    UNION ALL SELECT hx.range_id, hx.settled_at, hx.owner, hx.skipped WHERE iv.in_hole) p
  ) pr ON true
LEFT JOIN outbox_ranges lb ON o.batch_id = ANY(pr.skipped) AND lb.late_batch = o.batch_id
  AND pr.range_id BETWEEN lb.lo_id AND lb.hi_id
LEFT JOIN LATERAL (
  SELECT CASE WHEN o.batch_id = ANY(pr.skipped) THEN lb.range_id ELSE pr.range_id END,
         CASE WHEN o.batch_id = ANY(pr.skipped) THEN lb.settled_at ELSE pr.settled_at END,
         CASE WHEN o.batch_id = ANY(pr.skipped) THEN lb.owner ELSE pr.owner END
  ) fin(range_id, settled_at, owner) ON true
{{where}}
"""
STATUSES = (
    "SELECT d.id, d.status FROM (" + DERIVED.replace("{where}", "WHERE o.id = ANY(%(ids)s)") + ") d"
)


#: Work left for ranges: committed range-shaped rows past the cursor (``%(until)s``: due by
#: then), leased ranges' rows, ended holes and lifted batches not yet claimed late.
OPEN_WORK = f"""
SELECT (SELECT count(*) FROM outbox o, outbox_range_cursor c
        WHERE (o.xid, o.id) > (c.xid, c.id) AND {SHAPE} AND {UNPARKED} AND NOT o.row_path
          AND o.available_at <= %(until)s)
     + (SELECT coalesce(sum(rows), 0) FROM outbox_ranges WHERE settled_at IS NULL)
     + (SELECT count(*) FROM ({ENDED}) e) + (SELECT count(*) FROM ({LIFTED}) l)
"""
#: The row path's open rows: pending (due by ``%(until)s``) and in flight.
ROW_PATH_OPEN = f"""
SELECT (SELECT count(*) FROM outbox o WHERE o.status = 'pending' AND o.available_at <= %(until)s
          AND (o.row_path OR NOT ({SHAPE})))
     + (SELECT count(*) FROM outbox WHERE status = 'in_flight')
"""


class RangeClaim(NamedTuple):
    """One range a claim recorded and leased, and its rows to publish (members the row path
    does not own, due). ``rows`` may be empty: every member was the row path's."""

    range_id: int
    rows: list[ClaimedRow]


class RangeStore:
    """Claims, settles and exceptions of ranges (PostgreSQL)."""

    def __init__(self, db: OutboxDatabase | Engine) -> None:
        self.db = OutboxDatabase.of(db)
        if not self.db.is_postgres:
            raise ValueError("settlement by ranges needs PostgreSQL (SQLite settles rows)")

    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[RangeClaim]:
        """Late ranges first (lifted batches, ended holes), then the cursor's next ``limit``
        range-shaped rows as one range; each leased to ``owner``."""
        now = self.db.clock()
        params: dict[str, Any] = {
            "owner": owner,
            "now": now,
            "until": now + dt.timedelta(seconds=lease_seconds),
        }
        claims: list[RangeClaim] = []
        with self.db.begin() as conn:
            cx, ci, _ = _one(conn, CURSOR, {})
            # after the cursor's lock: a fresh snapshot sees every range that skipped a batch
            for batch, lo, hi in _all(conn, LIFTED, {}):
                claims += _ranges(
                    _all(conn, LATE_CLAIM, {**params, "b": batch, "lo": lo, "hi": hi})
                )
            for (hole,) in _all(conn, ENDED, {}):
                claims += _ranges(_all(conn, HOLE_CLAIM, {**params, "h": hole}))
            if limit > 0:
                claims += _ranges(_all(conn, CLAIM, {**params, "cx": cx, "ci": ci, "n": limit}))
        return claims

    def settle(self, *, owner: str, range_ids: Sequence[int]) -> int:
        """Every member of these ranges was acked or adopted: settled, in one write each."""
        return len(self.settle_ids(owner=owner, range_ids=range_ids))

    def settle_ids(self, *, owner: str, range_ids: Sequence[int]) -> list[int]:
        """:meth:`settle`; the ranges settled by ``owner``, now or by an earlier settle whose
        reply was lost (the others are no longer ``owner``'s: closed by ``expire``)."""
        params = {"owner": owner, "ranges": list(range_ids), "now": self.db.clock()}
        with self.db.begin() as conn:
            return [row[0] for row in _all(conn, SETTLE, params)]

    def leased(self, *, owner: str, range_ids: Sequence[int]) -> list[int]:
        """Of ``range_ids``, those ``owner`` leases now."""
        with self.db.begin() as conn:
            return [r[0] for r in _all(conn, LEASED, {"owner": owner, "ranges": list(range_ids)})]

    def renew(self, *, owner: str, range_ids: Sequence[int], lease_seconds: float) -> int:
        until = self.db.clock() + dt.timedelta(seconds=lease_seconds)
        return self._write(RENEW, {"owner": owner, "ranges": list(range_ids), "until": until})

    def adopt(self, *, owner: str, range_id: int, ids: Sequence[int]) -> list[int]:
        """Hand these members of a range ``owner`` holds to the row path, ``in_flight`` under
        the range's lease, before an outcome other than a confirm is written on them. Returns
        the ids adopted (a row the row path owns already is not)."""
        params = {"owner": owner, "range": range_id, "ids": list(ids)}
        with self.db.begin() as conn:
            return [row[0] for row in _all(conn, ADOPT, params)]

    def expire(self, *, owner: str | None = None, keep: Sequence[int] = ()) -> tuple[int, int]:
        """Ranges whose lease ran out (their publisher died or stalled), or with ``owner``
        those leased to it but not in ``keep`` (the ranges it holds): each member the row path
        does not own yet is handed to it, pending, a possible duplicate (``lost_confirms + 1``);
        the range is closed. Returns the ranges closed and the rows handed back."""
        now = self.db.clock()
        with self.db.begin() as conn:
            if owner is None:
                found = _all(conn, EXPIRED, {"now": now})
            else:
                found = _all(conn, ORPHANED, {"owner": owner, "keep": list(keep)})
            closed = [row[0] for row in found]
            if not closed:
                return 0, 0
            handed, _ = _one(conn, EXPIRE, {"now": now, "ranges": closed, "counted": True})
        return len(closed), int(handed)

    def orphans(
        self, *, owner: str, keep: Sequence[int], known: Sequence[int]
    ) -> tuple[int, int, int]:
        """Ranges leased to ``owner`` not in ``keep`` (the ranges it holds) are closed, their
        members the row path does not own yet handed to it, pending: a range in ``known`` (one
        the owner held and settled, a settle a database crash undid) as possible duplicates,
        any other (a claim whose reply was lost: never published) as they were. Returns the
        ranges closed and the rows handed back uncounted and counted."""
        now = self.db.clock()
        seen = set(known)
        with self.db.begin() as conn:
            found = [r[0] for r in _all(conn, ORPHANED, {"owner": owner, "keep": list(keep)})]
            rows = [0, 0]
            for counted in (False, True):
                closed = [r for r in found if (r in seen) is counted]
                if closed:
                    params = {"now": now, "ranges": closed, "counted": counted}
                    rows[counted] = int(_one(conn, EXPIRE, params)[0])
        return len(found), rows[0], rows[1]

    def open_work(self, *, due_within: float | None = None) -> int:
        """Rows ranges have still to take or settle (zero: drained, as far as ranges go)."""
        with self.db.begin() as conn:
            return int(_one(conn, OPEN_WORK, {"until": self._horizon(due_within)})[0])

    def row_path_open(self, *, due_within: float | None = None) -> int:
        """The row path's pending (due within ``due_within`` seconds) and in-flight rows."""
        with self.db.begin() as conn:
            return int(_one(conn, ROW_PATH_OPEN, {"until": self._horizon(due_within)})[0])

    def _horizon(self, due_within: float | None) -> dt.datetime:
        if due_within is None:
            return dt.datetime.max.replace(tzinfo=dt.UTC)
        return self.db.clock() + dt.timedelta(seconds=due_within)

    def members(self, range_ids: Sequence[int]) -> dict[int, set[int]]:
        found: dict[int, set[int]] = {r: set() for r in range_ids}
        with self.db.begin() as conn:
            for range_id, row_id in _all(conn, MEMBERS, {"ranges": list(range_ids)}):
                found[range_id].add(row_id)
        return found

    def statuses(self, ids: Sequence[int]) -> dict[int, str]:
        """Each row's status as the read views derive it."""
        with self.db.begin() as conn:
            return {row[0]: row[1] for row in _all(conn, STATUSES, {"ids": list(ids)})}

    def _write(self, sql: str, params: dict[str, Any]) -> int:
        with self.db.begin() as conn:
            return int(conn.exec_driver_sql(sql, {"now": self.db.clock(), **params}).rowcount)


def _all(conn: Connection, sql: str, params: dict[str, Any]) -> list[Any]:
    return list(conn.exec_driver_sql(sql, params).all())


def _one(conn: Connection, sql: str, params: dict[str, Any]) -> Any:
    return conn.exec_driver_sql(sql, params).one()


def _ranges(rows: list[Any]) -> list[RangeClaim]:
    """A claim statement's rows: ``(range_id, _, *ClaimedRow)``; no range when nothing was in
    its window (range_id NULL), a range with no rows to publish when its one row is all NULL."""
    if not rows or rows[0][0] is None:
        return []
    picked = [ClaimedRow._make(row[2:]) for row in rows if row[2] is not None]
    return [RangeClaim(rows[0][0], sorted(picked, key=lambda r: r.id))]
