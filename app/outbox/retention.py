"""Retention: the purge of confirmed rows past their retention (and their events), walked in
chunks of the primary key so no long lock or WAL burst stalls the publishers, and its audit."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Engine,
    Select,
    and_,
    delete,
    select,
)

from app.outbox.database import OutboxDatabase
from app.outbox.schema import events, outbox, samples
from app.outbox.states import Status


@dataclass(frozen=True)
class Walked:
    """What one walk of the purge did: rows deleted, rows read, and its floor: the highest id
    with every row up to it deleted, or not ``confirmed`` and written before the cutoff, when
    read. Such a row, once confirmed, has ``confirmed_at`` no earlier than the walk (less a
    write-back's lag), so none below the floor is past retention before ``older_than`` after
    the walk: a walk that soon after may start there (``outbox purge --every``: not re-reading
    old failed rows every pass)."""

    deleted: int
    read: int
    floor: int


class Retention:
    """How many rows a purge would delete, the purge, and its audit row."""

    def __init__(self, db: OutboxDatabase | Engine) -> None:
        self.db = OutboxDatabase.of(db)

    def count_purgeable(self, *, older_than: dt.timedelta, chunk: int = 10_000) -> int:
        """How many rows :meth:`purge_confirmed` would delete now (a dry run, the same walk)."""
        cutoff = self.db.clock() - older_than
        total, after = 0, 0
        with self.db.engine.connect() as conn:
            while True:
                window = conn.execute(_purge_window(after, chunk, cutoff)).all()
                doomed = _purgeable(window)
                total += len(doomed)
                if _past_retention(window, doomed, chunk):
                    return total
                after = window[-1].id

    def record_purge(
        self,
        *,
        actor: str,
        older_than: dt.timedelta,
        deleted: int,
        inbox_deleted: int = 0,
        sleep_coef: float = 0.0,
        seconds: float | None = None,
        every: float | None = None,
        passes: int | None = None,
    ) -> int:
        """An audit row for a purge (who, the retention and pacing it ran with, what was
        deleted and how long it took); for ``outbox purge --every``, the interval and how many
        passes the row covers."""
        result: dict[str, Any] = {"deleted": deleted, "inbox_deleted": inbox_deleted}
        if seconds is not None:
            result["seconds"] = round(seconds, 3)
        if passes is not None:
            result["passes"] = passes
        ran_with: dict[str, Any] = {
            "older_than_days": older_than.total_seconds() / 86400,
            "sleep_coef": sleep_coef,
        }
        if every is not None:
            ran_with["every_s"] = every
        with self.db.begin() as conn:
            return self.db.audit(
                conn,
                actor=actor,
                action="purge",
                count=deleted,
                filter=ran_with,
                result=result,
            )

    def purge_confirmed(
        self,
        *,
        older_than: dt.timedelta,
        chunk: int = 1000,
        on_chunk: Callable[[int], None] | None = None,
        sleep_coef: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> int:
        """Delete ``confirmed`` rows confirmed before ``now - older_than`` (and the publishers'
        samples older than that).

        Walks the primary key from the oldest row, ``chunk`` rows per transaction (so that no
        long lock or WAL burst stalls the publishers), deleting the confirmed rows past the
        retention among them; stops at the first window with nothing to delete whose rows were
        all written after the cutoff (a row is confirmed after it is written, and ids grow with
        time). Each window is an index range read: the purge costs the rows past retention plus
        one window, never a scan of the whole table. ``on_chunk`` hears each window's deletes.

        ``sleep_coef`` paces it beside live publishers: after a window that deleted rows, it
        sleeps ``sleep_coef`` times as long as that window took (``pt-archiver``'s
        ``--sleep-coef``). At 1 the purge holds the database at most half the time and takes
        twice as long, so its rows must take well under its interval: in the 30-minute soak a
        purge paced at 1 fell behind a minute's rows at 4,768 rows/s (bench/results/soak). 0, the
        default, runs the windows back to back."""
        return self.walk(
            older_than=older_than,
            chunk=chunk,
            on_chunk=on_chunk,
            sleep_coef=sleep_coef,
            sleep=sleep,
        ).deleted

    def walk(
        self,
        *,
        older_than: dt.timedelta,
        chunk: int = 1000,
        start_after: int = 0,
        on_chunk: Callable[[int], None] | None = None,
        sleep_coef: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Walked:
        """:meth:`purge_confirmed` from the row after ``start_after`` (a previous walk's
        :attr:`Walked.floor`, younger than ``older_than``; 0: the whole walk)."""
        cutoff = self.db.clock() - older_than
        with self.db.begin() as conn:  # the publishers' samples past retention go with them
            conn.execute(delete(samples).where(samples.c.at < cutoff))
        total, read, after, floor = 0, 0, start_after, start_after
        below = True  # every row read so far deleted or not confirmed
        while True:
            began = time.monotonic()
            with self.db.begin() as conn:
                window = conn.execute(_purge_window(after, chunk, cutoff)).all()
                doomed = _purgeable(window)
                deleted = 0
                if doomed:
                    deleted = conn.execute(
                        delete(outbox).where(
                            outbox.c.id.in_(doomed),
                            outbox.c.status == Status.CONFIRMED,
                            outbox.c.confirmed_at < cutoff,
                        )
                    ).rowcount
                    gone = ~select(outbox.c.id).where(outbox.c.id == events.c.outbox_id).exists()
                    conn.execute(delete(events).where(events.c.outbox_id.in_(doomed), gone))
            total += deleted
            read += len(window)
            if on_chunk is not None:
                on_chunk(deleted)
            for row in window if below else ():
                # a row confirmed within retention passes it before long, and a row written
                # after the cutoff may be confirmed with a time from before this walk (a
                # write-back's lag, a producer's backdating): the floor stops at either
                if (row.confirmed and not row.doomed) or row.fresh:
                    below = False
                    break
                floor = row.id
            if _past_retention(window, doomed, chunk):
                return Walked(deleted=total, read=read, floor=floor)
            after = window[-1].id
            if deleted and sleep_coef > 0:
                sleep(sleep_coef * (time.monotonic() - began))


def _purge_window(after: int, chunk: int, cutoff: dt.datetime) -> Select[Any]:
    """The next ``chunk`` rows by id after ``after`` (a range of the primary key), each with
    whether it is past retention and whether it was written after the cutoff (compared in
    SQL: a value a producer stored badly is never parsed here)."""
    confirmed = outbox.c.status == Status.CONFIRMED.value
    doomed = and_(confirmed, outbox.c.confirmed_at < cutoff)
    fresh = outbox.c.created_at >= cutoff
    return (
        select(
            outbox.c.id, doomed.label("doomed"), fresh.label("fresh"), confirmed.label("confirmed")
        )
        .where(outbox.c.id > after)
        .order_by(outbox.c.id)
        .limit(chunk)
    )


def _purgeable(window: Sequence[Any]) -> list[int]:
    return [r.id for r in window if r.doomed]


def _past_retention(window: Sequence[Any], doomed: Sequence[int], chunk: int) -> bool:
    """The walk is done: the table ended, or a window held nothing to delete and only rows
    written after the cutoff (later ids are later still)."""
    if len(window) < chunk:
        return True
    return not doomed and all(r.fresh for r in window)
