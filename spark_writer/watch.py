"""``wait="confirmed"``: poll the outbox until a recorded batch's rows are settled (driver side).

Each poll is one aggregate over the batch's own rows through ``ix_outbox_batch_written
(batch_id, created_at)``, never row by row, on one connection in autocommit: every statement
is its own short transaction, none stays open while the wait sleeps. Two more statements run
only when they can say something: the rows blocked behind a failed row of their ordering key
(when rows failed, or nothing moved since the last poll), and the first failure reasons (once,
at the end, when rows failed). The pause between polls grows from 50 ms to 0.5 s and is never
under ten times what the last poll took (``delivery.next_interval``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from spark_writer.db import PostgresStore, Store, open_store
from spark_writer.delivery import (
    FAILURES,
    FIRST_INTERVAL,
    Delivery,
    Poll,
    Reason,
    delivery_of,
    look_for_blocked,
    next_interval,
    settled,
)
from spark_writer.options import OutboxOptions

_FAILED = ", ".join(f"'{s}'" for s in FAILURES if s != "skipped")  # skip releases a key
_COUNTS = (
    "SELECT status, count(*), sum(CASE WHEN attempts > 0 THEN 1 ELSE 0 END) "
    "FROM outbox WHERE batch_id = {0} GROUP BY status"
)
#: open keyed rows of the batch with an earlier row of their key (any batch's) ended in a
#: failure: the claim never takes them until that row is republished or skipped
_BLOCKED = (
    "SELECT count(*) FROM outbox o WHERE o.batch_id = {0} "
    "AND o.status IN ('pending', 'in_flight') AND o.ordering_key IS NOT NULL "
    "AND EXISTS (SELECT 1 FROM outbox f WHERE f.ordering_key = o.ordering_key "
    f"AND f.id < o.id AND f.status IN ({_FAILED}))"
)
_REASON = "COALESCE(CAST(reply_code AS TEXT) || ' ' || reply_text, last_error, 'no reason kept')"
_REASONS = (
    f"SELECT status, {_REASON}, count(*), min(message_id) FROM outbox "
    "WHERE batch_id = {0} AND status IN ("
    + ", ".join(f"'{s}'" for s in FAILURES)
    + ") GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT {1}"
)
#: reasons a report names at most
REASONS_SHOWN = 5


class BatchRows:
    """The three statements, on one store, for one batch."""

    def __init__(self, store: Store, batch_key: str) -> None:
        self.store = store
        self.key = batch_key
        self.param = "%s" if isinstance(store, PostgresStore) else "?"

    def poll(self) -> Poll:
        rows = self._all(_COUNTS.format(self.param))
        counts = {str(status): int(n) for status, n, _ in rows}
        retrying = sum(int(claimed or 0) for status, _, claimed in rows if status == "pending")
        return Poll(counts=counts, retrying=retrying)

    def blocked(self) -> int:
        blocked: int = self._all(_BLOCKED.format(self.param))[0][0]
        return int(blocked)

    def reasons(self) -> list[Reason]:
        rows = self._all(_REASONS.format(self.param, REASONS_SHOWN))
        return [Reason(str(s), str(r), int(n), str(first)) for s, r, n, first in rows]

    def _all(self, sql: str) -> list[tuple[Any, ...]]:
        return list(self.store.conn.execute(sql, (self.key,)).fetchall())


def await_delivery(
    store: Store,
    *,
    batch_key: str,
    timeout: float,
    stopped: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Delivery:
    """Poll until every row of the batch is settled (or blocked behind a failed row of its
    key), ``timeout`` seconds passed, or ``stopped()`` says the streaming query was stopped
    (Spark's ``stop()`` waits for the batch function: it must not wait for the timeout); what
    became of the rows either way."""
    rows = BatchRows(store, batch_key)
    start = clock()
    deadline = start + timeout
    interval, previous = FIRST_INTERVAL, None
    while True:
        began = clock()
        poll = rows.poll()
        if look_for_blocked(poll, previous):
            poll = poll._replace(blocked=rows.blocked())
        now = clock()
        done = settled(poll)
        halted = not done and stopped is not None and stopped()
        if done or halted or now >= deadline:
            failed = any(poll.counts.get(s, 0) for s in FAILURES)
            return delivery_of(
                batch_key,
                poll,
                reasons=rows.reasons() if failed else (),
                waited=now - start,
                timed_out=not done and not halted,
                stopped=halted,
            )
        interval = next_interval(interval, query_seconds=now - began)
        sleep(min(interval, deadline - now))
        previous = poll


def wait_for_batch(
    options: OutboxOptions, batch_key: str, *, stopped: Callable[[], bool] | None = None
) -> Delivery:
    """``await_delivery`` on a connection of its own to the options' outbox."""
    with open_store(options.url, password_file=options.password_file) as store:
        return await_delivery(
            store, batch_key=batch_key, timeout=options.wait_timeout, stopped=stopped
        )
