"""How the outbox steers PostgreSQL's planner: every trick of the write side, as one design.

An outbox is a queue. Every row passes through in seconds, so the statistics of the last
ANALYZE never describe the table a statement meets: a backlog written since, a leased set that
was empty then, a held-batches table never analysed. And psycopg prepares a statement on its
fifth run, after which PostgreSQL may keep a *generic* plan, made without the parameters'
values, until the next ANALYZE. A plan chosen from stale numbers or without the values costs in
proportion to the backlog, on every claim or write-back. So the statements of the hot path do
not leave the plan to the statistics. Each trick below was added for a plan measured to be
wrong, and each has a test that explains the plan production's statements get
(``tests/integration/test_claim_plan.py``, ``test_claim_floor.py``). Each trick, the plan it
replaces, and what it buys:

- ``WALK_SETTINGS`` (sequential scans, bitmap scans and sorts off for the unkeyed claim's
  transaction). Without: a bitmap scan of every due row and a sort, or in the generic plan a
  sequential scan of the table and a sort; ~28 ms per claim and a confirm p50 of 64-124 ms
  instead of 23-34. With: an Index Scan of ``ix_outbox_due`` under a Limit, at any backlog.
- ``pending_test``: 'pending' written into the unkeyed claim, so the generic plan can prove
  ``ix_outbox_due``'s predicate; bound in the keyed claim, where written in it let the generic
  plan walk the due index and join every row to the key heads (400-780 ms per claim; bound,
  8,707-9,399 rows/s ordered).
- ``KEY_HEADS``: a loose index scan of ``ix_outbox_key_open``, one probe per open key however
  many rows wait behind its head.
- ``ANY_KEY_OPEN`` first: the keyed claim is skipped when no key is open (on an outbox without
  keys its plan walked every due row looking for a head); the same round trip makes the walk's
  settings, one round trip fewer per claim.
- ``NOT IN`` the held batches, not ``NOT EXISTS``: that became a hash anti-join over the whole
  outbox (``outbox_held``, never analysed, was guessed at 1,200 rows); 6,590-8,186 rows/s
  against 10,568-12,537.
- ``ClaimFloor``: the unkeyed walk starts from the last row taken, from the start once a second.
  A walk from the start steps over the index entries of every row claimed since the last VACUUM:
  117 buffers per claim against 3 after 30,000 rows claimed; 16.6 against 8.9 ms per claim with
  a million rows purged behind.
- ``status_by_id`` (``status || '' = ...``): write-backs no longer start from
  ``ix_outbox_lease`` after an ANALYZE that saw no row in flight (414-498 ms per write-back in
  the soak, a few ms after).
- ``BY_ID_SETTINGS`` (sequential and bitmap scans, hash and merge joins off for statements that
  find their rows by id): a write-back of 8,000 confirms took 3-38 s in ``make bench`` as a
  sequential scan joined to every id when the last ANALYZE saw no row leased; now a nested
  loop of ``outbox_pkey`` lookups, tens of ms.

Two more settings ride on the same statements without steering a plan: the claim bounds how
long its transaction may sit idle (``CLAIM_IDLE_TIMEOUT_MS``) and a publisher's write-back
commits without waiting for the disk (``ASYNC_COMMIT``), reading the WAL positions that tell it
later when that commit became durable. All of them are transaction-local (``set_config(...,
true)``): nothing leaks to the next user of a pooled connection.

SQLite has one plan per statement and no generic plans: there, only the statements' shapes
apply (the same SQL, without settings).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Text,
    TextClause,
    column,
    literal,
    literal_column,
    text,
)

from app.outbox.replication import STANDBYS_FLUSHED
from app.outbox.schema import KEY_OPEN, outbox
from app.outbox.states import Status

# ------------------------------------------------------------------------------ the claim

#: Walk ``ix_outbox_due`` in order, never a bitmap scan, a sequential scan or a sort, whatever
#: the statistics say. Sent before the unkeyed claim only: the keyed claim keeps the planner's
#: choice (it starts from the key heads).
WALK_SETTINGS = (
    "set_config('enable_bitmapscan', 'off', true) || set_config('enable_seqscan', 'off', true)"
    " || set_config('enable_sort', 'off', true)"
)
WALK_DUE_INDEX = text(f"SELECT {WALK_SETTINGS}")

#: Any row holding its ordering key open: the predicate and the order of ``ix_outbox_key_open``,
#: so it reads the first entry of that (small) index (``LIMIT 1`` alone chose a scan of the
#: whole table, which finds nothing when no row has a key).
_FIRST_OPEN_KEY = f"SELECT ordering_key FROM outbox WHERE {KEY_OPEN} ORDER BY ordering_key LIMIT 1"
ANY_KEY_OPEN = text(_FIRST_OPEN_KEY)

#: A claim's ``FOR UPDATE SKIP LOCKED`` keeps a lock on every row it locked and then dropped on
#: re-checking it (a row another publisher claimed a moment before). A publisher frozen between
#: its claim and its COMMIT (SIGSTOP, a GC or VM pause) held those rows, so the other
#: publisher's write-back of them waited the whole freeze (20 s at the default lease, issue 44).
#: Past this limit the server ends the frozen session and frees them; the claim is retried.
CLAIM_IDLE_TIMEOUT_MS = 500
#: PostgreSQL's SQLSTATE for a session ended by ``idle_in_transaction_session_timeout``.
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"

#: PostgreSQL, the claim's first statement: whether a key is open and, when none is (no keyed
#: claim will run), :data:`WALK_SETTINGS` at once; and the idle bound of the claim's transaction.
ANY_KEY_OPEN_ELSE_WALK = text(
    f"SELECT k.open, CASE WHEN k.open IS NULL THEN {WALK_SETTINGS} END,"
    f" set_config('idle_in_transaction_session_timeout', '{CLAIM_IDLE_TIMEOUT_MS}', true)"
    f" FROM (SELECT ({_FIRST_OPEN_KEY}) AS open OFFSET 0) AS k"  # OFFSET 0: one probe, not two
)

# the predicate of ix_outbox_key_open, on alias ``o`` (so the planner uses that index)
_OPEN = KEY_OPEN.replace("ordering_key", "o.ordering_key").replace("status", "o.status")
#: The head of every ordering key: its first row still open (not confirmed, not skipped). A
#: loose index scan over ``ix_outbox_key_open``: one probe per open key, however many rows wait
#: behind each head (a hot key with 100,000 waiting rows costs one probe, not 100,000).
KEY_HEADS = (
    text(
        f"""
WITH RECURSIVE keys(k) AS (
    SELECT (SELECT o.ordering_key FROM outbox o WHERE {_OPEN} ORDER BY o.ordering_key LIMIT 1)
    UNION ALL
    SELECT (SELECT o.ordering_key FROM outbox o WHERE o.ordering_key > keys.k AND {_OPEN}
            ORDER BY o.ordering_key LIMIT 1)
    FROM keys WHERE keys.k IS NOT NULL
)
SELECT (SELECT o.id FROM outbox o WHERE o.ordering_key = keys.k AND {_OPEN}
        ORDER BY o.id LIMIT 1) AS id
FROM keys WHERE keys.k IS NOT NULL
"""
    )
    .columns(column("id", BigInteger))
    .subquery("key_heads")
)


def written(value: Any) -> Any:
    """A value written into the statement, not bound: only then can a prepared statement's
    generic plan prove a partial index's predicate, such as ``status = 'pending'``."""
    return literal(value, literal_execute=True)


def pending_test(keyed: bool) -> Any:
    """'pending' for the claim's status test. Unkeyed: written into the statement, so the
    generic plan can prove ``ix_outbox_due``'s predicate and walk it. Keyed: bound; written in,
    it let the keyed claim's generic plan walk ``ix_outbox_due`` and join every row to the
    materialised key heads, where bound the plan starts from the key heads."""
    return Status.PENDING if keyed else written(Status.PENDING.value)


#: The unkeyed claim walks from the last row it claimed, not from the index's first entry: the
#: entries of every row claimed since the last VACUUM stay in ``ix_outbox_due`` until it runs,
#: and a walk from the start steps over all of them, a cost that grows with the traffic. Rows
#: that land behind that floor (committed by a transaction older than the floor's row, a held
#: batch released, a claim of another publisher rolled back, a row inserted with an old
#: ``available_at``) wait for the next walk from the start: one every this long.
CLAIM_REWALK = dt.timedelta(seconds=1)


class ClaimFloor:
    """Where the unkeyed claim's walk of ``ix_outbox_due`` starts (PostgreSQL): the
    ``(available_at, id)`` of the last row it took, or the start once per :data:`CLAIM_REWALK`,
    when there is no floor yet, and after :meth:`rewalk`."""

    def __init__(self) -> None:
        self._floor: tuple[dt.datetime, int] | None = None
        self._walked_at: dt.datetime | None = None
        self._rewalk = False

    def rewalk(self) -> None:
        """Rows were put back to pending, perhaps behind the floor (their ``available_at`` is
        now, which can equal the floor's): the next claim walks from the start. Called once
        their transaction committed, so that walk sees them."""
        self._rewalk = True

    def start(self, now: dt.datetime) -> tuple[dt.datetime, int] | None:
        """The floor this claim walks from, or None: from the start (and remembered as such)."""
        floor, walked = self._floor, self._walked_at
        floored = floor is not None and walked is not None and now - walked < CLAIM_REWALK
        if self._rewalk:
            self._rewalk = floored = False
        if not floored:
            self._walked_at = now
            return None
        return floor

    def moved(self, taken: Sequence[tuple[dt.datetime, int]]) -> None:
        """The walk took every row it could up to the last of ``taken`` (it skipped only rows
        locked by another claim or in a held batch): the next walk goes on from there."""
        if taken:
            self._floor = max(taken)


# -------------------------------------------------------------------------- write-backs


def status_by_id(status: Status | ColumnElement[Any]) -> ColumnElement[bool]:
    """``status = <status>`` (a status, or a value the statement carries, such as a column of
    the rows a write-back joins) for a statement that finds its rows by id (the write-backs, the
    lease renewal of held rows, the events recorded for rows just moved), written
    ``status || '' = '<status>'``: the same test, but one that proves no partial index's
    predicate, so the ids drive the plan (primary key lookups) whatever the statistics say.
    Written plainly it proves ``ix_outbox_lease``'s (``status = 'in_flight'``), and after an
    ANALYZE that saw next to no row in flight PostgreSQL started the write-back from that index
    and matched the ids in a filter. ``lease_owner = <owner>`` steered the plan the same way
    when the last ANALYZE saw no row leased: hence :data:`BY_ID_SETTINGS` too."""
    value = literal(status.value, Text) if isinstance(status, Status) else status
    return outbox.c.status.concat(literal_column("''")) == value


#: Statements that find their rows by id look each id up in ``outbox_pkey``: never a
#: sequential or bitmap scan, a hash or a merge join. The plan for a write-back of n ids: a
#: Nested Loop whose outer side is the ids (``unnest`` of the arrays, or the ``= ANY`` array)
#: and whose inner side an Index Scan using ``outbox_pkey`` per id.
BY_ID_SETTINGS = tuple(
    (f"enable_{kind}", "off") for kind in ("seqscan", "bitmapscan", "hashjoin", "mergejoin")
)
#: The publisher's outcomes: this transaction's commit does not wait for the disk.
ASYNC_COMMIT_SETTINGS = (("synchronous_commit", "off"),)


def set_local(settings: Sequence[tuple[str, str]]) -> TextClause:
    """Transaction-local settings in one statement (one round trip)."""
    calls = " || ".join(f"set_config('{name}', '{value}', true)" for name, value in settings)
    return text(f"SELECT {calls}")


#: With a commit that does not wait for the disk: how far the WAL is on disk now, where it
#: ends now (past the commit record of every transaction committed before this one), and how
#: far every streaming standby has it on disk (NULL: no standby; -1: a standby this role may not
#: read the position of, without pg_read_all_stats), as byte positions. The publisher learns
#: from them when its earlier write-backs became durable, on this server and on any standby a
#: failover may promote. Logical replication's senders (a CDC reader) are not standbys.
_WAL_POSITIONS = (
    ", pg_current_wal_flush_lsn() - '0/0', pg_current_wal_insert_lsn() - '0/0', " + STANDBYS_FLUSHED
)
BY_ID = set_local(BY_ID_SETTINGS)
ASYNC_COMMIT = text(set_local(ASYNC_COMMIT_SETTINGS).text + _WAL_POSITIONS)
ASYNC_COMMIT_BY_ID = text(set_local(ASYNC_COMMIT_SETTINGS + BY_ID_SETTINGS).text + _WAL_POSITIONS)
#: A commit that waits for the disk, and a standby may still lack it: the positions all the same.
POSITIONS = text("SELECT ''" + _WAL_POSITIONS)
POSITIONS_BY_ID = text(BY_ID.text + _WAL_POSITIONS)
