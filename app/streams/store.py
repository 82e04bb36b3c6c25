"""The stream relay's reads and writes: lanes leased one publisher at a time, claims that give
publishing ids, and the outcomes the broker answers.

A stream's rows belong to lane ``id % lanes``. A lane is one reference name on the broker, and
the broker drops a publishing id at or below the last one it stored for that name; so a lane's
ids strictly increase (``outbox_stream_lanes.next_seq``), a row keeps its id from its first claim
until it is settled, and a row is published under an id again only right after the broker was
asked which ids it has (:meth:`StreamStore.resume`), in id order. Every write of a lane's rows
happens in a transaction that holds its lane row locked and owned by the caller: a publisher
that lost its lane (its lease expired, an operator moved it) writes nothing of it.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Connection, and_, bindparam, case, func, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Engine

from app.outbox.database import OutboxDatabase
from app.outbox.schema import held, outbox, stream_lanes
from app.outbox.states import Status, check_transition

OPEN = (Status.PENDING.value, Status.IN_FLIGHT.value)
#: The columns a stream publish needs.
ROW_COLUMNS = (
    outbox.c.id,
    outbox.c.stream_seq,
    outbox.c.message_id,
    outbox.c.exchange,
    outbox.c.routing_key,
    outbox.c.body,
    outbox.c.content_type,
    outbox.c.headers,
    outbox.c.properties,
    outbox.c.attempts,
    outbox.c.created_at,
)


class LaneLost(RuntimeError):
    """The lane is no longer this publisher's: another took it over, or an operator moved it."""


@dataclass(frozen=True, slots=True)
class Lane:
    stream: str
    lane: int
    lanes: int
    reference: str
    #: another publisher held it before (its lease expired, or it was moved): a takeover
    taken_over: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.stream, self.lane)

    def rows(self) -> Any:
        """The condition of this lane's rows."""
        return and_(outbox.c.stream == self.stream, outbox.c.id % self.lanes == self.lane)


@dataclass(frozen=True, slots=True)
class StreamRow:
    id: int
    seq: int
    message_id: str
    exchange: str
    routing_key: str
    body: bytes
    content_type: str | None
    headers: Any
    properties: Any
    attempts: int
    created_at: dt.datetime | None


@dataclass(frozen=True, slots=True)
class Resumed:
    """What a lane's resume found: rows the broker already had (settled without a publish),
    and the rows to publish again under their ids, in id order."""

    stored: int
    settled: int
    again: list[StreamRow]


class StreamStore:
    def __init__(self, db: OutboxDatabase | Engine) -> None:
        self.db = OutboxDatabase.of(db)

    # ---------------------------------------------------------------- lanes

    def open_streams(self) -> list[str]:
        """Streams with rows not settled yet (``ix_outbox_stream_open``)."""
        stmt = select(outbox.c.stream).where(outbox.c.stream.is_not(None))
        stmt = stmt.where(outbox.c.status.in_(OPEN)).distinct()
        with self.db.begin() as conn:
            return sorted(conn.scalars(stmt))

    def ensure_lanes(self, stream: str, lanes: int) -> None:
        """Create a stream's lanes (``lanes`` of them) the first time it is seen; a stream's
        lane count never changes afterwards (its rows' lanes would move)."""
        with self.db.begin() as conn:
            if conn.execute(
                select(stream_lanes.c.lane).where(stream_lanes.c.stream == stream)
            ).first():
                return
            token = secrets.token_hex(6)
            rows = [
                {"stream": stream, "lane": n, "lanes": lanes, "reference": f"outbox-{token}-{n}"}
                for n in range(lanes)
            ]
            if self.db.is_postgres:
                from sqlalchemy.dialects.postgresql import insert as pg_insert

                conn.execute(pg_insert(stream_lanes).on_conflict_do_nothing(), rows)
            else:
                from sqlalchemy.dialects.sqlite import insert as lite_insert

                conn.execute(lite_insert(stream_lanes).on_conflict_do_nothing(), rows)

    def acquire(self, *, owner: str, streams: Sequence[str], lease_seconds: float) -> list[Lane]:
        """Renew the lanes of ``streams`` that are ours, and take those that are free or whose
        lease expired (a row lock held by a claim of ours is waited for; another publisher's
        lane being taken over at this moment is skipped)."""
        if not streams:
            return []
        now = self.db.clock()
        until = now + dt.timedelta(seconds=lease_seconds)
        of_streams = stream_lanes.c.stream.in_(list(streams))
        got: list[Lane] = []
        with self.db.begin() as conn:
            renewed = conn.execute(
                update(stream_lanes)
                .where(of_streams, stream_lanes.c.owner == owner)
                .values(lease_until=until)
                .returning(
                    stream_lanes.c.stream,
                    stream_lanes.c.lane,
                    stream_lanes.c.lanes,
                    stream_lanes.c.reference,
                )
            ).all()
            got += [Lane(*row) for row in renewed]
            free = or_(stream_lanes.c.owner.is_(None), stream_lanes.c.lease_until < now)
            pick = select(stream_lanes).where(
                of_streams, free, stream_lanes.c.owner.is_distinct_from(owner)
            )
            pick = pick.order_by("stream", "lane")
            if self.db.is_postgres:
                pick = pick.with_for_update(skip_locked=True)
            for row in conn.execute(pick).all():
                values: dict[str, Any] = {"owner": owner, "lease_until": until, "taken_at": now}
                if row.owner is not None:
                    values["takeovers"] = stream_lanes.c.takeovers + 1
                conn.execute(
                    update(stream_lanes)
                    .where(stream_lanes.c.stream == row.stream, stream_lanes.c.lane == row.lane)
                    .values(**values)
                )
                taken_over = row.owner is not None
                got.append(
                    Lane(row.stream, row.lane, row.lanes, row.reference, taken_over=taken_over)
                )
        got.sort(key=lambda lane: lane.key)
        return got

    def release(self, *, owner: str, lanes: Sequence[Lane]) -> None:
        """Give lanes up (a clean stop): another publisher may take them at once."""
        with self.db.begin() as conn:
            for lane in lanes:
                conn.execute(
                    update(stream_lanes)
                    .where(*self._held(owner, lane))
                    .values(owner=None, lease_until=None)
                )

    def move(
        self, *, stream: str, lane: int | None = None, actor: str, **who: Any
    ) -> dict[str, Any]:
        """An operator frees a stream's lanes (all, or one), audited: the next publisher to look
        takes each over and asks the broker its last stored id first; the one that held it
        writes nothing more of it (its next claim finds the lane gone). Safe at any moment:
        ids stay with their rows. Returns what was freed and the audit row's id."""
        cond = [stream_lanes.c.stream == stream, stream_lanes.c.owner.is_not(None)]
        if lane is not None:
            cond.append(stream_lanes.c.lane == lane)
        with self.db.begin() as conn:
            pick = select(stream_lanes.c.lane, stream_lanes.c.owner).where(*cond)
            if self.db.is_postgres:
                pick = pick.with_for_update()
            freed = [{"lane": r.lane, "owner": r.owner} for r in conn.execute(pick).all()]
            if freed:
                lanes = [f["lane"] for f in freed]
                conn.execute(
                    update(stream_lanes)
                    .where(stream_lanes.c.stream == stream, stream_lanes.c.lane.in_(lanes))
                    .values(owner=None, lease_until=None)
                )
            audit_id = self.db.audit(
                conn,
                actor=actor,
                action="move lane",
                filter={"stream": stream, "lane": lane},
                count=len(freed),
                result={"freed": freed},
                **who,
            )
        return {"stream": stream, "freed": freed, "audit_id": audit_id}

    @staticmethod
    def _held(owner: str, lane: Lane) -> tuple[Any, ...]:
        return (
            stream_lanes.c.stream == lane.stream,
            stream_lanes.c.lane == lane.lane,
            stream_lanes.c.owner == owner,
        )

    def _lock(
        self, conn: Connection, owner: str, lane: Lane, lease_seconds: float | None = None
    ) -> int:
        """Lock the lane's row if it is still ``owner``'s (renewing its lease); its next id.
        Raises :class:`LaneLost` otherwise."""
        pick = select(stream_lanes.c.next_seq).where(*self._held(owner, lane))
        if self.db.is_postgres:
            pick = pick.with_for_update()
        found = conn.execute(pick).first()
        if found is None:
            raise LaneLost(f"stream {lane.stream!r} lane {lane.lane} is no longer {owner}'s")
        if lease_seconds is not None:
            until = self.db.clock() + dt.timedelta(seconds=lease_seconds)
            conn.execute(
                update(stream_lanes).where(*self._held(owner, lane)).values(lease_until=until)
            )
        return int(found[0])

    # ---------------------------------------------------------------- rows

    def resume(
        self, *, owner: str, lane: Lane, stored: int, limit: int, lease_seconds: float
    ) -> Resumed:
        """After the broker said ``stored`` is the last id it has under the lane's reference:
        settle the lane's rows at or below it ``confirmed`` (never published again), and take
        the rows above it that already have an id into ``in_flight``, to go out again under the
        same ids, in order. Each such row counts a lost confirm: it may have reached the
        broker after ``stored`` was read (a publisher that lost the lane), and then the broker
        drops it. The lane's next id moves past ``stored`` (a database that lost writes)."""
        check_transition(Status.IN_FLIGHT, Status.CONFIRMED)
        now = self.db.clock()
        with self.db.begin() as conn:
            next_seq = self._lock(conn, owner, lane, lease_seconds)
            if next_seq <= stored:
                conn.execute(
                    update(stream_lanes).where(*self._held(owner, lane)).values(next_seq=stored + 1)
                )
            open_rows = and_(
                lane.rows(), outbox.c.status.in_(OPEN), outbox.c.stream_seq.is_not(None)
            )
            settled = conn.execute(
                update(outbox)
                .where(open_rows, outbox.c.stream_seq <= stored)
                .values(
                    status=Status.CONFIRMED,
                    confirmed_at=now,
                    published_at=func.coalesce(outbox.c.published_at, now),
                    lease_owner=None,
                    lease_until=None,
                    last_error=None,
                )
            ).rowcount
            pick = (
                select(outbox.c.id)
                .where(open_rows, outbox.c.stream_seq > stored)
                .order_by(outbox.c.stream_seq)
                .limit(limit)
            )
            ids = list(conn.scalars(pick))
            again = []
            if ids:
                again = self._take(
                    conn, owner, self.db.ids_in(ids), now, lease_seconds, resend=True
                )
        return Resumed(stored=stored, settled=int(settled), again=again)

    def claim(self, *, owner: str, lane: Lane, limit: int, lease_seconds: float) -> list[StreamRow]:
        """The lane's next due rows without an id, oldest first, into ``in_flight``, each given
        the lane's next id in id order. Never a row of a held batch."""
        check_transition(Status.PENDING, Status.IN_FLIGHT)
        now = self.db.clock()
        with self.db.begin() as conn:
            next_seq = self._lock(conn, owner, lane, lease_seconds)
            pick = (
                select(outbox.c.id)
                .where(
                    lane.rows(),
                    outbox.c.status == Status.PENDING,
                    outbox.c.stream_seq.is_(None),
                    outbox.c.available_at <= now,
                    outbox.c.batch_id.not_in(select(held.c.batch_id)),
                )
                .order_by(outbox.c.id)
                .limit(limit)
            )
            if self.db.is_postgres:
                pick = pick.with_for_update(skip_locked=True)
            ids = list(conn.scalars(pick))
            if not ids:
                return []
            conn.execute(
                update(stream_lanes)
                .where(*self._held(owner, lane))
                .values(next_seq=next_seq + len(ids))
            )
            seqs = list(range(next_seq, next_seq + len(ids)))  # ids are in row order
            if self.db.is_postgres:  # ids and their publishing ids side by side: one join
                given = select(
                    func.unnest(bindparam("claim_ids", ids, type_=ARRAY(BigInteger))).label("id"),
                    func.unnest(bindparam("claim_seqs", seqs, type_=ARRAY(BigInteger))).label(
                        "seq"
                    ),
                ).subquery("given")
                where: Any = outbox.c.id == given.c.id
                seq: Any = given.c.seq
            else:
                where = self.db.ids_in(ids)
                seq = case(dict(zip(ids, seqs, strict=True)), value=outbox.c.id)
            return self._take(conn, owner, where, now, lease_seconds, resend=False, seq=seq)

    def _take(
        self,
        conn: Connection,
        owner: str,
        where: Any,
        now: dt.datetime,
        lease_seconds: float,
        *,
        resend: bool,
        seq: Any = None,
    ) -> list[StreamRow]:
        """Rows matching ``where`` into ``in_flight`` under ``owner``'s lease, in one
        statement (with their publishing ids, ``seq``, on a first claim)."""
        values: dict[str, Any] = {
            "status": Status.IN_FLIGHT,
            "lease_owner": owner,
            "lease_until": now + dt.timedelta(seconds=lease_seconds),
            "attempts": outbox.c.attempts + 1,
            "claimed_at": now,
        }
        if resend:
            # claimed before: it may have been on the wire (an upper bound, as for exchanges)
            values["lost_confirms"] = outbox.c.lost_confirms + case(
                (outbox.c.status == Status.IN_FLIGHT, 1), else_=0
            )
        if seq is not None:
            values["stream_seq"] = seq
        stmt = update(outbox).where(where).values(**values).returning(*ROW_COLUMNS)
        rows = [StreamRow(*r[:2], *r[2:]) for r in conn.execute(stmt).all()]
        rows.sort(key=lambda r: r.seq)
        return rows

    def confirmed(
        self, *, owner: str, lane: Lane, ids: Sequence[int], published_at: dt.datetime
    ) -> int:
        """The broker confirmed these rows' ids: they are in the stream. Written whoever holds
        the lane now: a confirm is the broker's word for that id, and a row keeps its id until
        it is settled."""
        check_transition(Status.IN_FLIGHT, Status.CONFIRMED)
        now = self.db.clock()
        # not waiting for the disk: a confirm a database crash undoes leaves its row in flight
        # with its id, and the lane's next resume settles it by the broker's last stored id
        with self.db.unit_of_work(durable=False), self.db.begin(by_id=True) as conn:
            return int(
                conn.execute(
                    update(outbox)
                    .where(
                        self.db.ids_in(ids), outbox.c.status.in_(OPEN), outbox.c.stream.is_not(None)
                    )
                    .values(
                        status=Status.CONFIRMED,
                        confirmed_at=now,
                        published_at=func.coalesce(outbox.c.published_at, published_at),
                        lease_owner=None,
                        lease_until=None,
                        last_error=None,
                    )
                ).rowcount
            )

    def failed(
        self, *, owner: str, lane: Lane, ids: Sequence[int], reason: str, code: int | None = None
    ) -> int:
        """These rows cannot be stream messages (found before they were sent): ``failed``
        with the reason. Their ids are spent; a republish gives them new ones."""
        check_transition(Status.IN_FLIGHT, Status.FAILED)
        with self.db.begin() as conn:
            self._lock(conn, owner, lane)
            return int(
                conn.execute(
                    update(outbox)
                    .where(self.db.ids_in(ids), lane.rows(), outbox.c.status.in_(OPEN))
                    .values(
                        status=Status.FAILED,
                        lease_owner=None,
                        lease_until=None,
                        last_error=reason[:2000],
                        reply_code=code,
                    )
                ).rowcount
            )

    def fail_pending(self, *, owner: str, lane: Lane, reason: str, limit: int = 1000) -> int:
        """The lane's stream does not exist (or is refused) past its retry budget: its open
        rows end ``failed`` with the reason, a bounded number per call. A row with an id too:
        a stream that does not exist holds no message."""
        check_transition(Status.PENDING, Status.FAILED)
        check_transition(Status.IN_FLIGHT, Status.FAILED)
        with self.db.begin() as conn:
            self._lock(conn, owner, lane)
            pick = (
                select(outbox.c.id)
                .where(lane.rows(), outbox.c.status.in_(OPEN))
                .order_by(outbox.c.id)
                .limit(limit)
            )
            ids = list(conn.scalars(pick))
            if not ids:
                return 0
            return int(
                conn.execute(
                    update(outbox)
                    .where(self.db.ids_in(ids), outbox.c.status.in_(OPEN))
                    .values(
                        status=Status.FAILED,
                        last_error=reason[:2000],
                        lease_owner=None,
                        lease_until=None,
                    )
                ).rowcount
            )
