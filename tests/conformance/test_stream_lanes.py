"""The stream lanes' protocol against generated schedules (Hypothesis), checked by a model of the
broker's deduplication.

Each example is the real :class:`~app.streams.store.StreamStore` on a SQLite outbox of its own,
driven by publishers that follow the relay's rules (app/streams/relay.py): take lanes, ask the
broker its last stored id and resume, claim, send in id order, settle confirms and errors. The
schedule interleaves what can happen between them: more rows written, publishes sent and
answers delivered in any amounts, answers lost, connections cut, publishers killed, leases
expiring while the old holder still runs (it keeps sending what it had, a zombie), publish
errors, operators republishing failed rows. The fake broker stores a message only when its id
is above the last one stored under its reference, as RabbitMQ does, and confirms either way.

The rule checked, once every row has settled: the stream holds each confirmed row's message
exactly once, each row refused for good not at all, and a republished row once per life.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text, update

from app.db import make_engine
from app.outbox.enqueue import enqueue
from app.outbox.message import Message
from app.outbox.schema import outbox, stream_lanes
from app.streams.store import Lane, LaneLost, StreamStore

EXAMPLES = int(os.environ.get("CONFORMANCE_EXAMPLES", "150"))
FIXED = "CONFORMANCE_EXAMPLES" not in os.environ
STREAM = "s"
#: a publish error (RabbitMQ's are all of this kind): not stored, and the producer refuses
#: every later publish until a new session declares it; the relay ends the session
REFUSED = 6
#: a row that cannot be a message (too large, bad headers): failed by the relay before sending
LOCAL = -1
LEASE = 60.0


@dataclass
class Broker:
    """A stream and the last id stored per reference: a repeated or lower id is dropped (and
    confirmed), as RabbitMQ's stream writer does."""

    log: list[str] = field(default_factory=list)
    last: dict[str, int] = field(default_factory=dict)
    #: (reference, id) -> message id stored under it
    stored: dict[tuple[str, int], str] = field(default_factory=dict)

    def publish(
        self, ref: str, seq: int, message_id: str, error: int | None
    ) -> tuple[int, int | None]:
        if error is not None:
            return seq, error
        if seq > self.last.get(ref, 0):
            self.log.append(message_id)
            self.last[ref] = seq
            self.stored[(ref, seq)] = message_id
        return seq, None


@dataclass
class Conn:
    lane: Lane
    #: a publish error refused a publish of this producer: RabbitMQ refuses every later one
    #: too (the producer is gone with its leader), until a new session declares it again
    refusing: int | None = None
    #: publishing id -> (row id, message id): sent or to send, not answered
    pending: dict[int, tuple[int, str]] = field(default_factory=dict)
    to_send: list[tuple[int, int, str]] = field(default_factory=list)  # (seq, row id, message id)
    answers: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class Pub:
    owner: str
    conns: dict[tuple[str, int], Conn] = field(default_factory=dict)
    errors: list[int] = field(default_factory=list)  # codes the broker answers next sends with


class World:
    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        self.store = StreamStore(self.engine)
        self.broker = Broker()
        self.pubs: list[Pub] = []
        self.written = 0
        self.republished: Counter[str] = Counter()
        self.next_owner = 0

    def pub(self, n: int) -> Pub:
        while len(self.pubs) <= n % 3:
            self.next_owner += 1
            self.pubs.append(Pub(owner=f"p{self.next_owner}#stream"))
        return self.pubs[n % 3]

    # ------------------------------------------------------------ steps

    def write(self, n: int) -> None:
        msgs = [
            Message(stream=STREAM, body=b"x", message_id=f"m{i}")
            for i in range(self.written, self.written + n)
        ]
        with self.engine.begin() as conn:
            enqueue(conn, msgs)
        self.written += n

    def take(self, p: Pub) -> None:
        streams = self.store.open_streams()
        for s in streams:
            self.store.ensure_lanes(s, 2)
        lanes = self.store.acquire(owner=p.owner, streams=streams, lease_seconds=LEASE)
        held = {lane.key for lane in lanes}
        for key in list(p.conns):
            if key not in held:
                del p.conns[key]  # the relay stops a worker whose lane is gone
        for lane in lanes:
            if lane.key not in p.conns:
                self.connect(p, lane)

    def connect(self, p: Pub, lane: Lane) -> None:
        stored = self.broker.last.get(lane.reference, 0)
        try:
            resumed = self.store.resume(
                owner=p.owner, lane=lane, stored=stored, limit=1_000_000, lease_seconds=LEASE
            )
        except LaneLost:
            return
        conn = Conn(lane)
        conn.to_send = [(r.seq, r.id, r.message_id) for r in resumed.again]
        p.conns[lane.key] = conn

    def claim(self, p: Pub, k: int) -> None:
        for key, conn in list(p.conns.items()):
            try:
                rows = self.store.claim(owner=p.owner, lane=conn.lane, limit=k, lease_seconds=LEASE)
            except LaneLost:
                del p.conns[key]
                continue
            conn.to_send += [(r.seq, r.id, r.message_id) for r in rows]

    def send(self, p: Pub, k: int) -> None:
        """Up to ``k`` publishes of each connection go out, in order (zombies' too)."""
        for key, conn in list(p.conns.items()):
            batch, conn.to_send = conn.to_send[:k], conn.to_send[k:]
            local: list[int] = []
            for seq, row_id, message_id in batch:
                error = conn.refusing
                if error is None and p.errors:
                    error = p.errors.pop(0)
                    if error == LOCAL:
                        local.append(row_id)
                        continue
                    conn.refusing = error
                conn.pending[seq] = (row_id, message_id)
                answer = self.broker.publish(conn.lane.reference, seq, message_id, error)
                conn.answers.append(answer)
            try:
                if local:
                    self.store.failed(owner=p.owner, lane=conn.lane, ids=local, reason="local")
            except LaneLost:
                del p.conns[key]

    def deliver(self, p: Pub, k: int) -> None:
        for key, conn in list(p.conns.items()):
            got, conn.answers = conn.answers[:k], conn.answers[k:]
            confirmed = [conn.pending.pop(seq)[0] for seq, err in got if err is None]
            if confirmed:
                self.store.confirmed(
                    owner=p.owner, lane=conn.lane, ids=confirmed, published_at=_now()
                )
            if any(err is not None for _, err in got):  # the relay ends the session
                del p.conns[key]
                self.connect(p, conn.lane)

    def cut(self, p: Pub) -> None:
        """The connection drops: unsent publishes and unanswered ones are forgotten; the lane
        resumes on the next connect (its worker reconnects at once)."""
        for key, conn in list(p.conns.items()):
            del p.conns[key]
            self.connect(p, conn.lane)

    def kill(self, p: Pub) -> None:
        """kill -9: the process and all it had are gone; a new process takes its place."""
        self.next_owner += 1
        index = self.pubs.index(p)
        self.pubs[index] = Pub(owner=f"p{self.next_owner}#stream")

    def expire(self) -> None:
        """Time passes: every lane's lease is over (its holder may still run: a zombie)."""
        with self.engine.begin() as conn:
            conn.execute(update(stream_lanes).values(lease_until=_now() - _sec(1)))

    def republish(self) -> None:
        """An operator republishes the failed rows (each goes out again, under a new id)."""
        from app.outbox.actions import OperatorActions
        from app.outbox.scope import RepublishFilter

        with self.engine.connect() as conn:
            failed = list(
                conn.execute(
                    select(outbox.c.message_id).where(outbox.c.status == "failed")
                ).scalars()
            )
        if not failed:
            return
        flt = RepublishFilter.of(statuses=["failed"])
        OperatorActions(self.engine).republish(filter=flt, limit=1000, dry_run=False, actor="model")
        self.republished.update(failed)

    # ------------------------------------------------------------ end

    def finish(self) -> None:
        """Every publisher but a fresh one dies; it drains the outbox with a broker that
        answers everything at once."""
        self.expire()
        p = Pub(owner="final#stream")
        for _ in range(200):
            self.take(p)
            self.claim(p, 50)
            self.send(p, 10_000)
            self.deliver(p, 10_000)
            with self.engine.connect() as conn:
                left = conn.execute(
                    text("SELECT count(*) FROM outbox WHERE status IN ('pending', 'in_flight')")
                ).scalar_one()
            if not left:
                return
            with self.engine.begin() as conn:  # a requeued row's backoff is over
                conn.execute(update(outbox).values(available_at=_now() - _sec(1)))
        raise AssertionError("the outbox did not drain")

    def check(self) -> None:
        with self.engine.connect() as conn:
            rows = dict(conn.execute(select(outbox.c.message_id, outbox.c.status)).all())
        counts = Counter(self.broker.log)
        for message_id, status in rows.items():
            lives = 1 + self.republished[message_id]
            seen = counts[message_id]
            if status == "confirmed":
                assert 1 <= seen <= lives, (message_id, seen, lives)
                if not self.republished[message_id]:
                    assert seen == 1, (message_id, seen)
            else:
                assert status == "failed", (message_id, status)
                assert seen <= lives - 1, (message_id, seen, lives)


def _now() -> Any:
    import datetime as dt

    return dt.datetime.now(dt.UTC)


def _sec(n: float) -> Any:
    import datetime as dt

    return dt.timedelta(seconds=n)


# ---------------------------------------------------------------- schedules

PUB = st.integers(0, 2)
STEP = st.one_of(
    st.tuples(st.just("write"), st.integers(1, 12)),
    st.tuples(st.just("take"), PUB),
    st.tuples(st.just("claim"), PUB, st.integers(1, 8)),
    st.tuples(st.just("send"), PUB, st.integers(1, 8)),
    st.tuples(st.just("deliver"), PUB, st.integers(1, 8)),
    st.tuples(st.just("cut"), PUB),
    st.tuples(st.just("kill"), PUB),
    st.tuples(st.just("expire")),
    st.tuples(st.just("error"), PUB, st.sampled_from([REFUSED, REFUSED, LOCAL])),
    st.tuples(st.just("republish")),
)


def play(world: World, steps: list[tuple[Any, ...]]) -> None:
    for step in steps:
        name, *args = step
        if name == "write":
            world.write(args[0])
        elif name == "take":
            world.take(world.pub(args[0]))
        elif name == "claim":
            world.claim(world.pub(args[0]), args[1])
        elif name == "send":
            world.send(world.pub(args[0]), args[1])
        elif name == "deliver":
            world.deliver(world.pub(args[0]), args[1])
        elif name == "cut":
            world.cut(world.pub(args[0]))
        elif name == "kill":
            world.kill(world.pub(args[0]))
        elif name == "expire":
            world.expire()
        elif name == "error":
            world.pub(args[0]).errors.append(args[1])
        elif name == "republish":
            world.republish()
    world.finish()
    world.check()


@pytest.mark.timeout(1800)
@settings(
    max_examples=EXAMPLES,
    derandomize=FIXED,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(steps=st.lists(STEP, min_size=5, max_size=60))
def test_every_stream_schedule_is_exactly_once(
    steps: list[tuple[Any, ...]], template: Path, workdir: Path
) -> None:
    path = workdir / "streams.db"
    shutil.copyfile(template, path)
    world = World(f"sqlite:///{path}")
    try:
        world.write(10)
        try:
            play(world, steps)
        except BaseException:
            print("schedule:", steps)
            raise
    finally:
        world.engine.dispose()
        path.unlink()
