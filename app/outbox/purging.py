"""``outbox purge --every``: retention as a steady trickle instead of one purge a minute.

A purge run by cron once a minute deletes a minute of rows at once (about 200,000 at the soak's
rate) and leaves autovacuum as many dead tuples in one go. Run every few seconds, each pass
deletes a few seconds of rows: the same work per row, spread evenly (issue 47). One process
keeps running (a sidecar or a service beside the publishers), so no interpreter starts per pass.

A pass that fails (the database down, restarting, refusing connections) is reported and the
next pass tries again: nothing is lost, rows past retention wait. The passes' deletes are
audited together, one audit row per ``audit_every`` seconds that deleted anything (an audit row
per pass would bury the operators' own actions), and once more when the loop stops.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from app.logs import first_line
from app.outbox.retention import Retention


@dataclass
class Owed:
    """What the passes since the last audit row deleted."""

    deleted: int = 0
    inbox_deleted: int = 0
    passes: int = 0
    failed_passes: int = 0
    seconds: float = 0.0
    #: outbox rows the passes read, and the passes that walked from the table's first row
    read: int = 0
    full_walks: int = 0

    def add(self, other: Owed) -> None:
        self.deleted += other.deleted
        self.inbox_deleted += other.inbox_deleted
        self.passes += other.passes
        self.failed_passes += other.failed_passes
        self.seconds += other.seconds
        self.read += other.read
        self.full_walks += other.full_walks


@dataclass(frozen=True)
class PurgeSchedule:
    older_than: dt.timedelta
    inbox_older_than: dt.timedelta
    every: float
    audit_every: float
    chunk: int
    sleep_coef: float
    actor: str

    @property
    def full_walk_every(self) -> float:
        """Seconds between passes that walk from the table's first row; the others start at
        the last walk's floor (:class:`app.outbox.retention.Walked`). Half the retention at
        most, so a row below the floor that is confirmed later is deleted within half a
        retention of passing it, and an hour at most."""
        return min(3600.0, self.older_than.total_seconds() / 2)


class PurgeLoop:
    """A purge pass every ``schedule.every`` seconds until ``stop`` is set.

    ``inbox`` forgets the consumer kit's old inbox rows (``purge_inbox``); ``on_audit`` hears
    each audit row written, with what it covers (for the command's output)."""

    def __init__(
        self,
        retention: Retention,
        schedule: PurgeSchedule,
        *,
        inbox: Callable[[dt.timedelta, int], int],
        on_audit: Callable[[dict[str, Any]], None],
        on_failure: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.retention = retention
        self.schedule = schedule
        self.inbox = inbox
        self.on_audit = on_audit
        self.on_failure = on_failure
        self.clock = clock
        self.owed = Owed()  # not yet in an audit row
        self.total = Owed()  # since the start
        self.wall = wall
        #: when a pass last succeeded (the start until one has), and the last failure's reason
        #: while the latest pass failed: what /metrics and /readyz show
        self.last_success = wall()
        self.failing: str | None = None
        #: where the next pass starts (a walk's floor), and when the next whole walk is due
        self.floor = 0
        self.full_walk_due = clock()

    def run(self, stop: threading.Event) -> Owed:
        """Passes until ``stop``; then the last audit row. Returns the totals."""
        audited_at = self.clock()
        while True:
            began = self.clock()
            self._pass()
            due = self.clock() - audited_at >= self.schedule.audit_every
            if due and self._audit():
                audited_at = self.clock()
            pause = max(0.0, self.schedule.every - (self.clock() - began))
            if stop.is_set() or stop.wait(pause):
                self._audit()
                return self.total

    def _pass(self) -> None:
        s = self.schedule
        began = self.clock()
        done = Owed(passes=1)

        def deleted(n: int) -> None:  # each chunk as it commits: a failed pass counts its own
            done.deleted += n

        full = began >= self.full_walk_due
        try:
            walked = self.retention.walk(
                older_than=s.older_than,
                chunk=s.chunk,
                start_after=0 if full else self.floor,
                sleep_coef=s.sleep_coef,
                on_chunk=deleted,
            )
            self.floor, done.read, done.full_walks = walked.floor, walked.read, int(full)
            if full:
                self.full_walk_due = began + s.full_walk_every
            done.inbox_deleted = self.inbox(s.inbox_older_than, s.chunk)
        except SQLAlchemyError as error:
            done.failed_passes = 1
            failing: str | None = first_line(error)[:300]
            self.on_failure(failing or "")
        else:
            failing = None
        done.seconds = self.clock() - began
        self.owed.add(done)
        self.total.add(done)
        # after the totals: a scrape that sees this pass's outcome sees its counts too
        if failing is None:
            self.last_success = self.wall()
        self.failing = failing

    def _audit(self) -> bool:
        """An audit row for what the passes since the last one deleted (none when they
        deleted nothing). False when the database refused it: the next try carries it."""
        owed = self.owed
        if not owed.deleted and not owed.inbox_deleted:
            self.owed = Owed()
            return True
        try:
            audit_id = self.retention.record_purge(
                actor=self.schedule.actor,
                older_than=self.schedule.older_than,
                deleted=owed.deleted,
                inbox_deleted=owed.inbox_deleted,
                sleep_coef=self.schedule.sleep_coef,
                seconds=owed.seconds,
                every=self.schedule.every,
                passes=owed.passes,
            )
        except SQLAlchemyError as error:
            self.on_failure(f"the audit row could not be written ({first_line(error)[:300]})")
            return False
        self.on_audit({**asdict(owed), "audit_id": audit_id})
        self.owed = Owed()
        return True
