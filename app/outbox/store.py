"""The publisher's store: the claim and every outcome of a publish, one batched statement per
call (the hot path).

Every write is guarded by ``status = 'in_flight' AND lease_owner = :owner``: a publisher whose
lease has expired (and whose rows another publisher may hold now) changes nothing, and the counts
returned tell it so.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    Select,
    Text,
    bindparam,
    cast,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import DBAPIError

from app.outbox.database import OutboxDatabase, by_multiplicity, storable
from app.outbox.heldrows import HeldRowUpdates
from app.outbox.planner import (
    ANY_KEY_OPEN,
    ANY_KEY_OPEN_ELSE_WALK,
    CLAIM_IDLE_TIMEOUT_MS,
    IDLE_IN_TRANSACTION_TIMEOUT,
    KEY_HEADS,
    WALK_DUE_INDEX,
    ClaimFloor,
    pending_test,
    status_by_id,
    written,
)
from app.outbox.records import Backoff, ClaimedRow, Published, RetryOutcome, ReturnedRow
from app.outbox.recount import Recounts
from app.outbox.schema import held, outbox
from app.outbox.states import Status, check_transition

log = logging.getLogger("app.outbox.store")

PUBLISH_FACTS = ("channel_id", "delivery_tag", "published_at")
#: The claim reads the JSON columns as text: decoding them here would let one row's content
#: (3,000 levels of nesting, say) fail the whole claim, for every publisher, forever.
CLAIM_COLUMNS = (
    outbox.c.id,
    outbox.c.message_id,
    outbox.c.batch_id,
    outbox.c.exchange,
    outbox.c.routing_key,
    outbox.c.mandatory,
    outbox.c.body,
    outbox.c.content_type,
    cast(outbox.c.headers, Text).label("headers"),
    cast(outbox.c.properties, Text).label("properties"),
    outbox.c.ordering_key,
    outbox.c.attempts,
    outbox.c.max_attempts,
)


class PublisherStore(Recounts):
    """The publisher's reads and writes of outbox rows: claims and outcomes."""

    def __init__(self, db: OutboxDatabase | Engine) -> None:
        self.db = OutboxDatabase.of(db)
        # the claim statements (keyed, from a floor), built once
        self._claims: dict[tuple[bool, bool], Any] = {}
        #: where the unkeyed claim's walk starts (PostgreSQL); rows this repository put back
        #: to pending may sit behind it: ``_walk_from_start`` once their transaction committed
        self._floor = ClaimFloor()
        self._update_rows = HeldRowUpdates(self.db)
        #: claims run again because the server ended their session, idle past the bound
        self.claims_retried = 0  # the write-backs' one statement
        #: the unkeyed claim takes only the row path's rows (publishers settling by ranges,
        #: app/outbox/ranged.py): rows written before 0023, ``row_path``, delayed
        self.row_path_only = False

    def _walk_from_start(self) -> None:
        self._floor.rewalk()

    # ---------------------------------------------------------------- hot path

    def _due(
        self, now: Any, limit: Any, *, keyed: bool, floor: tuple[Any, Any] | None = None
    ) -> Select[tuple[int]]:
        """Due pending rows, oldest first: rows without an ordering key, or (``keyed``) only the
        head of each ordering key, the first of its rows not yet confirmed or skipped. Never a
        row of a held batch (``outbox_held``: a Spark batch written but not yet recorded); a
        held head holds its key back. ``floor``: only rows at or after this ``(available_at,
        id)``, in the index's order (a range condition on ix_outbox_due)."""
        due = (
            select(outbox.c.id)
            .where(outbox.c.status == pending_test(keyed), outbox.c.available_at <= now)
            # NOT IN, not NOT EXISTS: PostgreSQL cannot turn it into an anti-join, so the plan
            # stays the walk of ix_outbox_due with the (few) held batch ids hashed once per
            # statement, whatever it guesses about outbox_held (never analysed, it guessed 1,200
            # rows and chose a hash anti-join over a scan of the whole outbox on every claim)
            .where(outbox.c.batch_id.not_in(select(held.c.batch_id)))
            .order_by(outbox.c.available_at, outbox.c.id)
            .limit(limit)
        )
        if keyed:
            due = due.where(outbox.c.id.in_(select(KEY_HEADS.c.id)))
        else:
            due = due.where(outbox.c.ordering_key.is_(None))
            if self.row_path_only:  # ix_outbox_row_path_due's predicate, in its words
                due = due.where(
                    or_(outbox.c.xid.is_(None), outbox.c.row_path, outbox.c.not_before.is_not(None))
                )
        # a stream's rows go out through its lanes (app/streams), never on a channel (a stream
        # row has no ordering key: the message model and the Spark writers refuse one)
        if not keyed:
            due = due.where(outbox.c.stream.is_(None))
        if floor is not None:
            due = due.where(tuple_(outbox.c.available_at, outbox.c.id) >= tuple_(*floor))
        return due.with_for_update(skip_locked=True) if self.db.is_postgres else due

    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedRow]:
        """:meth:`claim_once`, again at once when the server ended its session for sitting idle
        in its transaction past :data:`CLAIM_IDLE_TIMEOUT_MS`: the process was paused (a GC, a
        starved CPU, a VM) between two of the claim's statements. Its transaction rolled back
        and its locks are gone, so claiming again is safe; a CI run on two busy cores saw a
        0.5 s pause there. A second such end is raised."""
        try:
            return self.claim_once(owner=owner, limit=limit, lease_seconds=lease_seconds)
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != IDLE_IN_TRANSACTION_TIMEOUT:
                raise
            log.warning(
                "claim by %s: the server ended its session, idle in its transaction over %d ms "
                "(the process was paused); claiming again",
                owner,
                CLAIM_IDLE_TIMEOUT_MS,
            )
            self.claims_retried += 1
            return self.claim_once(owner=owner, limit=limit, lease_seconds=lease_seconds)

    def claim_once(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedRow]:
        """Take up to ``limit`` due rows, oldest first, into ``in_flight`` under a lease.

        PostgreSQL: ``FOR UPDATE SKIP LOCKED`` in a CTE, so concurrent claimers never share a row.
        SQLite: one statement under SQLite's single-writer lock (and one publisher at a time).

        Rows with an ordering key are claimed only as their key's head: no earlier row of the
        key is still open (pending, in flight, or a terminal failure that parks the key). So at
        most one row per key is ever in flight, whichever publisher holds it, and a row is first
        published only after every earlier row of its key was confirmed (or skipped). A head
        that another claimer has just taken is seen as in flight once its lock is released
        (PostgreSQL re-checks ``status`` of a row it had to wait for), never claimed twice.
        """
        check_transition(Status.PENDING, Status.IN_FLIGHT)
        if limit <= 0:
            return []
        now = self.db.clock()
        params: dict[str, Any] = {
            "claim_now": now,
            "claim_owner": owner,
            "claim_until": now + dt.timedelta(seconds=lease_seconds),
            "claim_limit": limit,
        }
        rows: list[Any] = []
        try:
            with self.db.begin() as conn:
                # PostgreSQL: one round trip says whether a key is open and, when none is,
                # makes the unkeyed claim's walk settings (app/outbox/planner.py)
                if self._any_key_open(conn):
                    rows = list(conn.execute(self._claim_statement(True), params).all())
                    if self.db.is_postgres and len(rows) < limit:
                        conn.execute(WALK_DUE_INDEX)
                if len(rows) < limit:
                    params["claim_limit"] = limit - len(rows)
                    rows += self._claim_unkeyed(conn, params, now)
        except BaseException:
            # the floor moved past rows this transaction took and then rolled back (the
            # server ended an idle session, a commit failed): walk from the start next time
            self._floor.rewalk()
            raise
        claimed = [ClaimedRow._make(row) for row in rows]
        claimed.sort(key=lambda r: r.id)
        return claimed

    def _any_key_open(self, conn: Connection) -> bool:
        """Whether a row holds its ordering key open. PostgreSQL: when none does, the same
        round trip makes the unkeyed claim's settings; it also bounds the claim's idle time."""
        if not self.db.is_postgres:
            return conn.execute(ANY_KEY_OPEN).first() is not None
        return conn.execute(ANY_KEY_OPEN_ELSE_WALK).scalar() is not None

    def _claim_unkeyed(
        self, conn: Connection, params: dict[str, Any], now: dt.datetime
    ) -> list[Any]:
        """The unkeyed claim; on PostgreSQL from the :class:`ClaimFloor` (its rows come back
        with their ``available_at`` last, which moves the floor and is cut off here)."""
        if not self.db.is_postgres:
            return list(conn.execute(self._claim_statement(False), params).all())
        floor = self._floor.start(now)
        if floor is not None:
            params = {**params, "floor_at": floor[0], "floor_id": floor[1]}
        got = conn.execute(self._claim_statement(False, floored=floor is not None), params).all()
        self._floor.moved([(row[-1], row[0]) for row in got])
        return [row[:-1] for row in got]

    def _claim_statement(self, keyed: bool, *, floored: bool = False) -> Any:
        """The claim, built once per repository and kind, its values bound: building it and
        its cache key for every claim is Python work on the claim's path. The unkeyed claim on
        PostgreSQL also returns each row's ``available_at`` (for the floor)."""
        stmt = self._claims.get((keyed, floored))
        if stmt is not None:
            return stmt
        now = bindparam("claim_now", type_=outbox.c.available_at.type)
        floor = None
        if floored:
            floor = (
                bindparam("floor_at", type_=outbox.c.available_at.type),
                bindparam("floor_id", type_=BigInteger),
            )
        due = self._due(now, bindparam("claim_limit", type_=Integer), keyed=keyed, floor=floor)
        if self.db.is_postgres:
            cte = due.cte("due")
            stmt = update(outbox).where(outbox.c.id == cte.c.id)
        else:
            stmt = update(outbox).where(outbox.c.id.in_(due.scalar_subquery()))
        stmt = stmt.values(
            status=Status.IN_FLIGHT,
            lease_owner=bindparam("claim_owner", type_=outbox.c.lease_owner.type),
            lease_until=bindparam("claim_until", type_=outbox.c.lease_until.type),
            attempts=outbox.c.attempts + 1,
            channel_id=None,
            delivery_tag=None,
            claimed_at=now,
        )
        extra = (outbox.c.available_at,) if self.db.is_postgres and not keyed else ()
        stmt = stmt.returning(*CLAIM_COLUMNS, *extra)
        self._claims[(keyed, floored)] = stmt
        return stmt

    # ---------------------------------------------------------------- outcomes

    def record_published(
        self,
        *,
        owner: str,
        channel_id: int,
        tags: Sequence[tuple[int, int]],
        published_at: dt.datetime | None = None,
    ) -> int:
        """Note on each held row the channel and delivery tag it was published with, and when
        (``published_at``, default now)."""
        values = {"channel_id": channel_id, "published_at": published_at or self.db.clock()}
        return self._update_rows(owner, tags, ["delivery_tag"], values)

    def mark_confirmed(
        self, *, owner: str, ids: Sequence[int] = (), published: Sequence[Published] = ()
    ) -> int:
        """Broker acked (and did not return) these publishes.

        Rows given in ``published`` also get their channel, delivery tag and publish time in the
        same statement (one row version: no separate "published" write per row).
        """
        values = {
            "status": Status.CONFIRMED,
            "confirmed_at": self.db.clock(),
            "lease_owner": None,
            "lease_until": None,
            "last_error": None,
        }
        check_transition(Status.IN_FLIGHT, Status.CONFIRMED)
        with self.db.unit_of_work():
            return self._confirm(owner, ids, published, values)

    def _confirm(
        self,
        owner: str,
        ids: Sequence[int],
        published: Sequence[Published],
        values: dict[str, Any],
    ) -> int:
        moved = 0
        if ids:
            values_no_status = {k: v for k, v in values.items() if k != "status"}
            moved += self.db.transition(
                ids=ids,
                source=Status.IN_FLIGHT,
                target=Status.CONFIRMED,
                owner=owner,
                values=values_no_status,
            )
        if published:  # each a tuple (id, *PUBLISH_FACTS)
            moved += self._update_rows(owner, published, PUBLISH_FACTS, values)
        return moved

    def mark_returned(
        self, *, owner: str, returns: Sequence[ReturnedRow], published: Sequence[Published] = ()
    ) -> int:
        """Broker returned these mandatory publishes as unroutable (``basic.return``); rows in
        ``published`` also get their channel, tag and publish time, in the same statement."""
        check_transition(Status.IN_FLIGHT, Status.RETURNED)
        facts = {p.id: (p.channel_id, p.delivery_tag, p.published_at) for p in published}
        now = self.db.clock()
        values = {
            "status": Status.RETURNED,
            "confirmed_at": now,
            "lease_owner": None,
            "lease_until": None,
        }
        reply = ["reply_code", "reply_text", "last_error"]
        with_facts, without = [], []
        for r in returns:
            text = storable(r.reply_text)
            row = (r.id, r.reply_code, text, f"returned by broker: {r.reply_code} {text}")
            if r.id in facts:
                with_facts.append((*row, *facts[r.id]))
            else:
                without.append(row)
        with self.db.unit_of_work():
            moved = self._update_rows(owner, with_facts, [*reply, *PUBLISH_FACTS], values) + (
                self._update_rows(owner, without, reply, values)
            )
            self.db.record_events(
                kind="returned",
                ids=[r.id for r in returns],
                at=now,
                where=[status_by_id(Status.RETURNED), outbox.c.confirmed_at == now],
            )
            return moved

    def mark_failed(self, *, owner: str, ids: Sequence[int], reason: str) -> int:
        """A permanent error (oversized body, destination gone past its budget): keep the reason."""
        values = {"last_error": storable(reason), "lease_owner": None, "lease_until": None}
        with self.db.unit_of_work():
            moved = self.db.transition(
                ids=ids, source=Status.IN_FLIGHT, target=Status.FAILED, owner=owner, values=values
            )
            self.db.record_events(
                kind="failed",
                ids=ids,
                at=self.db.clock(),
                where=[
                    status_by_id(Status.FAILED),
                    outbox.c.last_error == values["last_error"],
                ],
            )
            return moved

    def retry(
        self,
        *,
        owner: str,
        ids: Sequence[int],
        error: str,
        backoff: Backoff,
        exhausted: Status,
        max_attempts: int | None = None,
        nack: bool = False,
    ) -> RetryOutcome:
        """Back to ``pending`` after a jittered backoff, or to ``exhausted`` once the budget is
        spent.

        ``nack``: the broker nacked the rows; each row's ``nacks`` goes up and is the budget
        spent (``nacks >= max_attempts``): lost confirms, counted in ``attempts``, never end a
        row. Otherwise (destination errors) the budget is ``attempts`` against ``max_attempts``
        when given, else each row's own.
        """
        check_transition(Status.IN_FLIGHT, exhausted)
        if not ids:
            return RetryOutcome(0, 0)
        error = storable(error)
        now = self.db.clock()
        held = select(outbox.c.id, outbox.c.attempts, outbox.c.max_attempts, outbox.c.nacks).where(
            self.db.held(owner, ids)
        )
        if self.db.is_postgres:
            held = held.with_for_update()
        with self.db.unit_of_work(), self.db.begin(by_id=True) as conn:  # rows stay locked
            rows = conn.execute(held).all()
            spent_rows = [r for r in rows if _spent(r, max_attempts=max_attempts, nack=nack)]
            spent = [r.id for r in spent_rows]
            again = [r for r in rows if r not in spent_rows]
            if spent:
                values: dict[str, Any] = {
                    "status": exhausted,
                    "last_error": error,
                    "lease_owner": None,
                    "lease_until": None,
                }
                if nack:
                    values["nacks"] = outbox.c.nacks + 1
                conn.execute(update(outbox).where(self.db.held(owner, spent)).values(**values))
            if again:
                self._reschedule(owner, again, now=now, error=error, backoff=backoff, nack=nack)
            self.db.record_events(
                kind=exhausted.value, ids=spent, at=now, where=[status_by_id(exhausted)]
            )
            self.db.record_events(
                kind="retry",
                ids=[r.id for r in again],
                at=now,
                where=[status_by_id(Status.PENDING)],
            )
        return RetryOutcome(retried=len(again), exhausted=len(spent))

    def _reschedule(
        self,
        owner: str,
        rows: Sequence[Any],
        *,
        now: dt.datetime,
        error: str,
        backoff: Backoff,
        nack: bool = False,
    ) -> None:
        values = {
            "status": Status.PENDING,
            "last_error": error,
            "lease_owner": None,
            "lease_until": None,
        }
        if nack:  # the backoff grows with the nacks, not with lost confirms
            due = [
                (r.id, now + dt.timedelta(seconds=backoff.delay(r.nacks + 1)), r.nacks + 1)
                for r in rows
            ]
            self._update_rows(owner, due, ["available_at", "nacks"], values)
            return
        plain = [(r.id, now + dt.timedelta(seconds=backoff.delay(r.attempts))) for r in rows]
        self._update_rows(owner, plain, ["available_at"], values)

    def postpone(self, *, owner: str, ids: Sequence[int], error: str, delay: float) -> int:
        """Held rows back to ``pending``, due in ``delay`` seconds, with no budget spent: their
        destination is out (it nacks everything), not the rows at fault."""
        if not ids:
            return 0
        values = {
            "status": Status.PENDING,
            "last_error": storable(error),
            "lease_owner": None,
            "lease_until": None,
            "available_at": self.db.clock() + dt.timedelta(seconds=delay),
        }
        with self.db.begin(by_id=True) as conn:
            return conn.execute(
                update(outbox).where(self.db.held(owner, ids)).values(**values)
            ).rowcount

    def release(
        self,
        *,
        owner: str,
        ids: Sequence[int],
        lost: bool,
        error: str | None = None,
        delay: float = 0.0,
    ) -> int:
        """Give held rows back to ``pending``, due now (or in ``delay`` seconds).

        ``lost=True``: they were published but their confirm will never come (channel or
        connection gone), so the next publish may be a duplicate: count it in ``lost_confirms``.
        """
        now = self.db.clock()
        values: dict[str, Any] = {
            "available_at": now + dt.timedelta(seconds=delay) if delay else now,
            "lease_owner": None,
            "lease_until": None,
            "lost_confirms": outbox.c.lost_confirms + (1 if lost else 0),
        }
        if error is not None:
            values["last_error"] = storable(error)
        with self.db.unit_of_work():
            moved = self.db.transition(
                ids=ids,
                source=Status.IN_FLIGHT,
                target=Status.PENDING,
                owner=owner,
                values=values,
            )
            if lost:
                self.db.record_events(
                    kind="lost",
                    ids=ids,
                    at=values["available_at"],
                    where=[
                        status_by_id(Status.PENDING),
                        outbox.c.available_at == values["available_at"],
                    ],
                )
            if moved:
                self.db.on_commit(self._walk_from_start)
            return moved

    def resend(self, *, owner: str, ids: Sequence[int], error: str) -> int:
        """Held rows published again without a new claim (a quarantine's isolated publish): a
        new attempt, and the earlier publish counts as a possible duplicate. They stay
        ``in_flight`` with this owner. A row named twice (two resends in one write-back, after
        a failed one) was published again twice: both count."""
        moved = 0
        with self.db.begin(by_id=True) as conn:
            for times, group in by_multiplicity(ids):
                values = {
                    "attempts": outbox.c.attempts + times,
                    "lost_confirms": outbox.c.lost_confirms + times,
                    "last_error": storable(error),
                    "channel_id": None,
                    "delivery_tag": None,
                }
                moved += sum(
                    conn.execute(
                        update(outbox).where(self.db.held(owner, chunk)).values(**values)
                    ).rowcount
                    for chunk in self.db.chunks(group)
                )
        return moved

    def release_expired(self) -> int:
        """Rows of a publisher that died (lease expired) go back to ``pending``.

        Each counts a lost confirm: the publisher records delivery tags lazily (batched with the
        outcomes), so a row without a tag may still have been on the wire. ``lost_confirms`` is
        therefore an upper bound of the duplicates, never an undercount.
        """
        now = self.db.clock()
        # a stream's rows stay with their lane, whose lease governs them (app/streams): put
        # back to pending here, one could go out again after later ids of its lane
        expired = (
            outbox.c.status == Status.IN_FLIGHT,
            outbox.c.lease_until < now,
            outbox.c.stream.is_(None),
        )
        where: Any = expired
        if self.db.is_postgres:
            # step past rows a live (or frozen) publisher has locked: one UPDATE over all of
            # them waited on a frozen publisher's retry() for as long as it stayed frozen, and
            # a dead publisher's rows waited with it
            pick = select(outbox.c.id).where(*expired).with_for_update(skip_locked=True)
            where = (outbox.c.id.in_(pick.scalar_subquery()),)
        stmt = (
            update(outbox)
            .where(*where)
            .values(
                status=Status.PENDING,
                available_at=now,
                lease_owner=None,
                lease_until=None,
                lost_confirms=outbox.c.lost_confirms + 1,
                last_error="lease expired: publisher stopped without settling",
            )
        )
        with self.db.begin() as conn:
            moved = int(conn.execute(stmt).rowcount)
        if moved:
            self.db.on_commit(self._walk_from_start)
        return moved

    # settling by ranges (app/outbox/ranged.py) overrides these; settling rows, none apply
    def range_members(self, ids: Iterable[int]) -> set[int]:
        """Of ``ids``, the rows held as a range's members."""
        return set()

    def renew(self, *, owner: str, lease_seconds: float) -> int:
        """Extend the leases of the ranges this publisher holds (the heartbeat)."""
        return 0

    def release_orphans(self, *, owner: str) -> tuple[int, int]:
        """Close the ranges leased to ``owner`` that it does not hold (the orphan check): the
        rows handed back uncounted (never published) and counted (possible duplicates)."""
        return 0, 0

    def leased_ids(self, *, owner: str) -> list[int]:
        """Ids of the ``in_flight`` rows leased to ``owner`` (to find rows a lost reply hid)."""
        stmt = select(outbox.c.id).where(
            outbox.c.status == Status.IN_FLIGHT, outbox.c.lease_owner == owner
        )
        with self.db.begin() as conn:
            return list(conn.scalars(stmt))

    def count_open(self, *, due_within: float | None = None) -> int:
        """Rows not settled yet (``pending`` or ``in_flight``): zero means the outbox is drained.

        Two counts in one statement, each reading its own partial index (``ix_outbox_due``,
        ``ix_outbox_lease``) with the status written into the statement, so that a prepared
        statement's generic plan can use them too. ``status IN ('pending', 'in_flight')`` proves
        neither index's predicate: it read the whole table (0.35-0.58 s for a 0.6-1.1 GB outbox
        in the soak, in parallel on both cores).

        ``due_within``: count only the pending rows due within so many seconds (a range of
        ``ix_outbox_due``): a delayed message due tomorrow is not this run's work."""
        counts = [
            select(func.count())
            .select_from(outbox)
            .where(outbox.c.status == written(status.value))
            .scalar_subquery()
            for status in (Status.PENDING, Status.IN_FLIGHT)
        ]
        if due_within is not None:
            horizon = self.db.clock() + dt.timedelta(seconds=due_within)
            counts[0] = (
                select(func.count())
                .select_from(outbox)
                .where(outbox.c.status == written(Status.PENDING.value))
                .where(outbox.c.available_at <= horizon)
                .scalar_subquery()
            )
        with self.db.begin() as conn:
            return int(conn.execute(select(counts[0] + counts[1])).scalar_one())


def _spent(row: Any, *, max_attempts: int | None, nack: bool) -> bool:
    """Is this retry the row's last? A nack spends the nack budget; anything else the attempts."""
    if nack:
        return bool(row.nacks + 1 >= row.max_attempts)
    return bool(row.attempts >= (max_attempts or row.max_attempts))
