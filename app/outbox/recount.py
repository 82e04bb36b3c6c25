"""After a lease was lost, or a database failover or crash undid commits: which publishes of
this publisher are possible duplicates now (counted on their rows), and which confirms can be
written again instead of the rows going out again (docs/guarantees.md section 8). A part of
:class:`~app.outbox.store.PublisherStore`, which the publisher calls on its database thread."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

from sqlalchemy import and_, or_, select, update

from app.outbox.database import OutboxDatabase, by_multiplicity, storable
from app.outbox.planner import status_by_id
from app.outbox.records import Published
from app.outbox.schema import outbox
from app.outbox.states import Status, check_transition


class Recounts:
    db: OutboxDatabase

    def published_again(
        self, published: Sequence[Published], bare: Sequence[int] = ()
    ) -> list[int]:
        """Of rows the broker confirmed whose confirm this publisher could not record (no
        longer held), those the database does not show confirmed by this very publish: another
        publisher holds or confirmed them, or they are pending again (a lease swept while this
        publisher was paused, a failover that undid its claim or a write-back). Each was or will
        be published again: a possible duplicate. A row confirmed with this publish's time was
        confirmed by this publisher's own earlier write-back whose COMMIT reply was lost: not a
        duplicate; nor is a ``bare`` row (no publish facts) found confirmed."""
        ours = {p.id: _utc(p.published_at) for p in published}
        ids = [*ours, *bare]
        again: list[int] = []
        with self.db.begin(by_id=True) as conn:
            for chunk in self.db.chunks(ids):
                stmt = select(outbox.c.id, outbox.c.status, outbox.c.published_at).where(
                    self.db.ids_in(chunk)
                )
                for row_id, status, at in conn.execute(stmt):
                    mine = row_id not in ours or (at is not None and _utc(at) == ours[row_id])
                    if not (Status(status) is Status.CONFIRMED and mine):
                        again.append(row_id)
        return sorted(again)

    def recheck(
        self, published: Sequence[Published], messages: Mapping[int, str]
    ) -> tuple[list[int], list[str]]:
        """After an outage: rows this publisher confirmed (``published``, with each row's
        ``message_id`` in ``messages``), found by message id, since a failover to a standby
        behind the primary may hand the same id to another message. Returns the ids of the rows
        holding these messages now that the database does not show confirmed by this very
        publish (another's, or another publish: a possible duplicate each), and the message ids
        found nowhere (their insert undone too: a producer that writes them again, a Spark
        replay, makes them due again)."""
        facts = {messages[p.id]: _utc(p.published_at) for p in published if p.id in messages}
        wanted = list(facts)
        again: list[int] = []
        found: set[str] = set()
        with self.db.begin() as conn:
            for start in range(0, len(wanted), 1000):
                chunk = wanted[start : start + 1000]
                stmt = select(
                    outbox.c.id, outbox.c.message_id, outbox.c.status, outbox.c.published_at
                ).where(outbox.c.message_id.in_(chunk))
                for row_id, message_id, status, at in conn.execute(stmt):
                    found.add(message_id)
                    mine = at is not None and _utc(at) == facts[message_id]
                    if not (Status(status) is Status.CONFIRMED and mine):
                        again.append(row_id)
        return sorted(again), [m for m in wanted if m not in found]

    def count_again(self, ids: Sequence[int], *, error: str) -> int:
        """Rows :meth:`published_again` found: each was or will be published again, so count a
        possible duplicate (``lost_confirms + 1``, ``error`` as the last error, a ``lost``
        event) whatever their status and lease now. Their status is not touched: whoever holds
        them settles them. Returns how many rows it counted."""
        if not ids:
            return 0
        counted = 0
        with self.db.unit_of_work(), self.db.begin(by_id=True) as conn:
            for times, group in by_multiplicity(ids):  # a row named twice: two publishes
                for chunk in self.db.chunks(group):
                    stmt = (
                        update(outbox)
                        .where(self.db.ids_in(chunk))
                        .values(
                            lost_confirms=outbox.c.lost_confirms + times,
                            last_error=storable(error),
                        )
                    )
                    counted += conn.execute(stmt).rowcount * times
            self.db.record_events(kind="lost", ids=sorted(set(ids)), at=self.db.clock(), where=[])
        return counted

    def confirm_again(
        self,
        *,
        owner: str,
        published: Sequence[Published],
        messages: Mapping[int, str] | None = None,
    ) -> list[int]:
        """Rows this publisher confirmed in a write-back that a database failover or crash
        undid, found ``pending`` and nobody's (the claim undone too) or back ``in_flight`` under
        this publisher's lease (the write-back alone undone): the broker's confirm stands, so
        it is written again with its publish facts, and the row is not published again (no
        duplicate). A row another publisher claimed meanwhile is left to it (and counted by
        :meth:`count_again`). With ``messages`` (each fact's id -> its message id) the row is
        found by its message id (a failover may have given its id to another message).
        Returns the ids of the rows confirmed again."""
        check_transition(Status.PENDING, Status.CONFIRMED)
        now = self.db.clock()
        again: list[int] = []
        undone = or_(
            and_(status_by_id(Status.PENDING), outbox.c.lease_owner.is_(None)),
            and_(status_by_id(Status.IN_FLIGHT), outbox.c.lease_owner == owner),
        )
        with self.db.unit_of_work(), self.db.begin(by_id=True) as conn:
            for fact in published:
                message = messages.get(fact.id) if messages is not None else None
                which = (
                    outbox.c.id == fact.id if message is None else outbox.c.message_id == message
                )
                stmt = (
                    update(outbox)
                    .where(which, undone)
                    .values(
                        status=Status.CONFIRMED,
                        confirmed_at=now,
                        published_at=fact.published_at,
                        channel_id=fact.channel_id,
                        delivery_tag=fact.delivery_tag,
                        lease_owner=None,
                        lease_until=None,
                        last_error=None,
                    )
                )
                if message is None:
                    if conn.execute(stmt).rowcount:
                        again.append(fact.id)
                else:
                    again.extend(conn.scalars(stmt.returning(outbox.c.id)))
        return again

    def held_ids(self, *, owner: str, ids: Sequence[int]) -> set[int]:
        """Of ``ids``, the rows ``owner`` holds (``in_flight`` under its lease) now."""
        with self.db.begin(by_id=True) as conn:
            return {
                row_id
                for chunk in self.db.chunks(ids)
                for row_id in conn.scalars(select(outbox.c.id).where(self.db.held(owner, chunk)))
            }


def _utc(at: dt.datetime) -> dt.datetime:
    """A stored time as an aware UTC time (SQLite gives it back naive)."""
    return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)
