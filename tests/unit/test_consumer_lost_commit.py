"""Regressions found by the consumer core's generated schedules (``test_consumer_core.py``), here
with the real jobs (:mod:`app.consumer.work`) on an in-memory SQLite inbox, driven by the core.

Both follow a ``COMMIT`` that committed but whose reply was lost (the connection broke):

- the window runs again and its handler now fails on the message (its effect is there already:
  its own unique key, say): the message was charged a failed attempt, requeued, and at
  ``delivery_limit`` dead-lettered although its effect was done. Now the failure's record finds
  it in the inbox: not charged, acked, counted ``handled``;
- a message published twice in that window: both copies were flagged "maybe committed", so the
  duplicate was counted ``handled`` too (``handled`` 2 for one effect). Now it is ``deduplicated``.
"""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.pool import StaticPool

from app.consumer.config import ConsumerConfig, ConsumerMetrics
from app.consumer.core import Frame, KitCore, KitState, Outage, Start
from app.consumer.held import Message
from app.consumer.work import Jobs
from app.outbox.schema import consumer_attempts, inbox


class LosesACommitReply:
    """A DB-API connection whose next ``commit`` commits, then raises (the reply lost)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.lose_next = False

    def commit(self) -> None:
        self._conn.commit()
        if self.lose_next:
            self.lose_next = False
            raise sqlite3.OperationalError("server closed the connection unexpectedly")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def sqlite_inbox() -> tuple[Engine, LosesACommitReply]:
    raw = LosesACommitReply(sqlite3.connect(":memory:", check_same_thread=False))
    engine = create_engine("sqlite://", creator=lambda: raw, poolclass=StaticPool)

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:  # pysqlite: BEGIN as SQLAlchemy means it
        conn.exec_driver_sql("BEGIN")

    inbox.metadata.create_all(engine, tables=[inbox, consumer_attempts])
    return engine, raw


class Kit:
    """The core, run by hand: deliveries in, each job run at once on the real work module."""

    def __init__(self, engine: Engine, handler: Any, *, limit: int = 1) -> None:
        self.now = 0.0
        config = ConsumerConfig(name="c", queue="q", delivery_limit=limit, batch_size=10)
        self.state = KitState(
            config=config,
            metrics=ConsumerMetrics(),
            outage=Outage(name="c", max_delay=1.0, rng=random.Random(0)),
            clock=lambda: self.now,
        )
        self.core = KitCore(self.state)
        self.jobs = Jobs(engine=engine, config=config, handler=handler)
        self.frames: list[Frame] = []

    def deliver(self, *mids: str) -> None:
        for tag, mid in enumerate(mids, start=1):
            message = Message(message_id=mid, body=b"", routing_key="q", exchange="")
            self.core.delivered(tag, message, redelivered=False)

    def run(self, *, before_each: Any = None) -> None:
        for _ in range(20):
            self.core.pump()
            commands = self.core.take()
            self.frames += [c for c in commands if isinstance(c, Frame)]
            starts = [c for c in commands if isinstance(c, Start)]
            if not starts and not self.core.held:
                return
            for start in starts:
                if before_each is not None:
                    before_each()
                self.core.job_done(start.window, self.jobs.run(start.lane, start.window))
            self.now += 2.0  # past any outage's backoff
        raise AssertionError("the kit did not settle")


def test_a_window_run_again_after_a_lost_commit_reply_charges_no_one() -> None:
    engine, raw = sqlite_inbox()
    runs: list[str] = []

    def handler(message: Message, conn: Connection) -> None:
        runs.append(message.message_id)
        if len(runs) > 2:  # run again: the effect is there already (its unique key)
            raise ValueError("duplicate key value violates unique constraint")

    kit = Kit(engine, handler, limit=1)
    kit.deliver("a", "b")
    raw.lose_next = True
    kit.run()
    m = kit.state.metrics.counts
    assert runs[:2] == ["a", "b"] and len(runs) >= 3
    assert m["dead_lettered"] == 0 and m["requeued"] == 0, m
    assert m["handled"] == 2 and m["deduplicated"] == 0
    assert [(f.kind, f.tag) for f in kit.frames if f.kind != "ack"] == []
    assert sum(f.count for f in kit.frames) == 2
    with engine.connect() as conn:
        assert conn.execute(consumer_attempts.select()).all() == []


def test_a_duplicate_in_a_window_whose_commit_reply_was_lost_is_deduplicated() -> None:
    engine, raw = sqlite_inbox()
    kit = Kit(engine, lambda message, conn: None)
    kit.deliver("a", "a")  # the same message published twice, in one window
    raw.lose_next = True
    kit.run()
    m = kit.state.metrics.counts
    assert (m["handled"], m["deduplicated"]) == (1, 1), m
    assert sum(f.count for f in kit.frames if f.kind == "ack") == 2
