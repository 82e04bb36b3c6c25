"""The console's batch list counts from indexes only (``timings=False``): the same numbers as
the full summary, which reads every row of the batches, for rows in every status."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import update

from app.db import make_engine
from app.outbox.read.batches import list_batches
from app.outbox.schema import outbox
from app.outbox.states import Status
from tests.support.factories import add_rows

LEASE = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)


def test_index_only_tallies_equal_the_full_summaries(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        a = add_rows(engine, n=40, batch_id="s:1")
        add_rows(engine, n=7, batch_id="s:2")  # all pending
        b = add_rows(engine, n=12, batch_id="s:3")
        with engine.begin() as conn:

            def put(ids: list[str], status: Status, **values: object) -> None:
                conn.execute(
                    update(outbox)
                    .where(outbox.c.message_id.in_(ids))
                    .values(status=status.value, **values)
                )

            put(a[:20], Status.CONFIRMED)
            put(a[20:23], Status.IN_FLIGHT, lease_owner="p", lease_until=LEASE)
            put(a[23:25], Status.RETURNED, reply_code=312)
            put(a[25:26], Status.NACKED)
            put(a[26:28], Status.FAILED, last_error="bad")
            put(a[28:29], Status.SKIPPED)
            put(a[:4], Status.CONFIRMED, lost_confirms=2)  # possible duplicates
            put(b, Status.CONFIRMED)
            put(b[:1], Status.CONFIRMED, lost_confirms=1)
        full = list_batches(engine, limit=10).items
        quick = list_batches(engine, limit=10, timings=False).items
        assert [s.batch_id for s in quick] == [s.batch_id for s in full]
        by_id = {s.batch_id: s for s in full}
        for s in quick:
            assert s.counts == by_id[s.batch_id].counts, s.batch_id
            assert s.rows == by_id[s.batch_id].rows
            assert s.republished == by_id[s.batch_id].republished
            assert s.first_created_at == by_id[s.batch_id].first_created_at
            assert s.last_created_at == by_id[s.batch_id].last_created_at
            assert s.last_confirmed_at is None  # the list leaves the timings to a batch's page
        one = {s.batch_id: s for s in quick}["s:1"]
        assert one.counts[Status.CONFIRMED] == 20 and one.counts[Status.PENDING] == 11
        assert one.counts[Status.IN_FLIGHT] == 3 and one.republished == 8
    finally:
        engine.dispose()
