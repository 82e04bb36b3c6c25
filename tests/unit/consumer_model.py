"""A reference model around the consumer kit's pure core (:mod:`app.consumer.core`).

The core is driven the way :mod:`app.consumer.kit` drives it (every event, then its commands
carried out, then a pump), against three small models:

- :class:`Broker`: one queue, channels whose delivery tags start at 1, a prefetch, acks (single
  and ``multiple``), nacks and rejects checked against what is outstanding, a channel close that
  returns the unsettled deliveries flagged redelivered;
- :class:`Db`: the consumer's database as the jobs see it (the inbox, the attempts rows, the
  effects), which can be out (refused) or lose the reply of a ``COMMIT`` that did commit;
- the jobs (:meth:`Sim.window_job`, :meth:`Sim.single_job`): what :mod:`app.consumer.work` does
  with a window or a message alone, with handlers that follow a plan per message (``ok``,
  ``raise``, ``hang`` until released, ``crash`` the process). A job is a generator: it stops in a
  handler that hangs, while time passes and the core cuts or times it out.

:class:`Sim` checks the invariants as it goes (:class:`Broken` when one fails) and
:meth:`Sim.settle` that everything ends: every delivery settled once, every message's effect
recorded once or the message dead-lettered.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Literal

from app.consumer.config import ConsumerConfig, ConsumerMetrics
from app.consumer.core import (
    Abandoned,
    Command,
    DeadLetter,
    Frame,
    KitCore,
    KitState,
    Outage,
    Start,
    limit_verdict,
)
from app.consumer.held import Held, Message, Outcome, Window

Behaviour = Literal["ok", "raise", "hang", "crash"]
FAULTS = ("raise", "crash")
TIMEOUT = 10.0  # the kit's handler_timeout in the model's seconds


class Broken(AssertionError):
    """An invariant does not hold."""


class DatabaseDown(Exception):
    """The consumer's database refused the job."""


class Crash(Exception):
    """A handler killed the consumer's process."""


Job = Generator[None, None, Outcome]


@dataclass
class Db:
    up: bool = True
    lose_commit_reply: bool = False
    inbox: set[str] = field(default_factory=set)
    attempts: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    effects: Counter[str] = field(default_factory=Counter)

    def charge(self, mid: str, error: str | None = None) -> int:
        count, last = self.attempts.get(mid, (0, None))
        self.attempts[mid] = (count + 1, error or last)
        return count + 1

    def commit(self, mids: list[str]) -> None:
        for mid in mids:
            if mid in self.inbox:
                raise Broken(f"{mid}: its effect recorded twice")
            self.inbox.add(mid)
            self.effects[mid] += 1


@dataclass
class Broker:
    prefetch: int
    ready: deque[tuple[str, bool]] = field(default_factory=deque)  # (message_id, redelivered)
    channel: int = 1
    next_tag: int = 1
    outstanding: dict[int, str] = field(default_factory=dict)
    dead_lettered: list[str] = field(default_factory=list)  # published to the dead-letter queue
    rejected: list[str] = field(default_factory=list)
    acked: int = 0

    def close(self) -> None:
        """The channel is gone: what it had not settled comes back, flagged redelivered."""
        for mid in reversed(self.outstanding.values()):
            self.ready.appendleft((mid, True))
        self.outstanding.clear()
        self.channel += 1
        self.next_tag = 1


class Sim:
    """One consumer process after another (a crash starts the next) against the models."""

    def __init__(
        self,
        *,
        config: ConsumerConfig,
        plans: dict[str, list[Behaviour]],
        copies: list[str],
        batch_handler: bool = False,
    ) -> None:
        self.cfg = config
        self.plans = {mid: deque(plan) for mid, plan in plans.items()}
        self.batch_handler = batch_handler
        self.hangs_time_out = False  # when it settles: hung handlers return after their timeout
        self.now = 0.0
        self.db = Db()
        self.broker = Broker(prefetch=config.prefetch)
        self.broker.ready.extend((mid, False) for mid in copies)
        self.copies = Counter(copies)
        self.faults: Counter[str] = Counter()  # tries that failed through the message's fault
        self.disruptions = 0  # channel closes, crashes, database outages
        self.verdicts: dict[str, list[str]] = {"requeue": [], "dead": []}
        self.handled = 0  # the metric, summed over the processes
        self.dead_letter_metric = 0
        self.jobs: dict[Window, tuple[KitCore, Job]] = {}  # not started yet
        self.blocked: dict[Window, tuple[KitCore, Job]] = {}  # in a handler that hangs
        self.lanes: dict[Window, str] = {}
        self.dl_tags: set[int] = set()  # delivery tags of the channel dead-lettered by a copy
        self.start_process()

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"Sim(mode={c.mode}, batch_handler={self.batch_handler}, prefetch={c.prefetch}, "
            f"concurrency={c.concurrency}, batch_size={c.batch_size}, limit={c.delivery_limit}, "
            f"multiple={c.ack_multiple}, dlx={c.dead_letter_exchange}, "
            f"plans={ {m: list(p) for m, p in self.plans.items()} }, copies={dict(self.copies)})"
        )

    # ------------------------------------------------------------ the consumer process

    def start_process(self) -> None:
        if hasattr(self, "state"):
            self.handled += self.state.metrics.counts["handled"]
            self.dead_letter_metric += self.state.metrics.counts["dead_lettered"]
        self.state = KitState(
            config=self.cfg,
            metrics=ConsumerMetrics(),
            outage=Outage(name="m", max_delay=5.0, rng=random.Random(0)),
            batch_handler=self.batch_handler,
            clock=lambda: self.now,
        )
        self.core = KitCore(self.state)

    def crash(self) -> None:
        self.disruptions += 1
        self.jobs.clear()
        self.blocked.clear()
        self.broker.close()
        self.dl_tags.clear()
        self.start_process()

    def close_channel(self) -> None:
        """The broker closes the channel: a new core on the same consumer; the old one's jobs
        still report to it, and what it decides goes nowhere."""
        self.disruptions += 1
        self.core.channel_closed()
        self.core.close()
        self.broker.close()
        self.dl_tags.clear()
        self.core = KitCore(self.state)

    # ------------------------------------------------------------ events and commands

    def carry_out(self, core: KitCore, commands: list[Command] | None = None) -> None:
        commands = core.take() if commands is None else commands
        if core is not self.core:
            return  # its channel is gone: frames and dead letters fail, the broker re-sends
        for command in commands:
            if isinstance(command, Frame):
                self.frame(command)
            elif isinstance(command, Start):
                self.lanes[command.window] = command.lane
                self.jobs[command.window] = (core, self.job(command.lane, command.window))
            elif isinstance(command, DeadLetter):
                self.broker.dead_lettered.append(command.held.message_id)
                self.dl_tags.add(command.held.tag)
                core.dead_letter_sent(command.held)
                self.carry_out(core)
            elif isinstance(command, Abandoned):
                self.timed_out(command.window)

    def timed_out(self, window: Window) -> None:
        """A handler ran past its timeout: its message's fault, unless a batch handler's."""
        running = window.running
        batch = self.batch_handler and self.lanes.get(window) == "window"
        if running is not None and not batch:
            self.faults[running[0].message_id] += 1

    def pump(self) -> None:
        core = self.core
        down, busy = self.state.outage.down, bool(core.jobs)
        core.pump()
        commands = core.take()
        starts = [c for c in commands if isinstance(c, Start)]
        if down and starts:
            # the database is out: one probe at a time, one delivery, after the backoff
            if busy or len(starts) > 1 or len(starts[0].window.items) > 1:
                raise Broken(f"started {len(starts)} jobs while the database is out")
            if self.now < self.state.outage.next_try:
                raise Broken("probed the database before its backoff passed")
        self.carry_out(core, commands)

    def after(self, core: KitCore) -> None:
        self.carry_out(core)
        self.pump()

    def frame(self, frame: Frame) -> None:
        out = self.broker.outstanding
        if frame.tag not in out:
            raise Broken(f"{frame.kind} of tag {frame.tag}: not outstanding (settled twice?)")
        if frame.kind == "ack":
            tags = [t for t in out if t <= frame.tag] if frame.multiple else [frame.tag]
            if len(tags) != frame.count:
                raise Broken(f"ack {frame} settles {len(tags)} tags, not {frame.count}")
            for tag in tags:
                mid = out.pop(tag)
                if mid not in self.db.inbox and tag not in self.dl_tags:
                    raise Broken(f"tag {tag} ({mid}) acked before its effect committed")
                self.broker.acked += 1
        elif frame.kind == "nack":
            mid = out.pop(frame.tag)
            if mid not in self.verdicts["requeue"]:
                raise Broken(f"{mid} requeued without a recorded failure")
            self.broker.ready.append((mid, True))
        else:
            mid = out.pop(frame.tag)
            if mid and mid not in self.verdicts["dead"]:
                raise Broken(f"{mid} rejected without a dead-letter verdict")
            self.broker.rejected.append(mid)

    # ------------------------------------------------------------ steps

    def deliver(self, n: int) -> None:
        b = self.broker
        for _ in range(n):
            if not b.ready or len(b.outstanding) >= b.prefetch:
                break
            mid, redelivered = b.ready.popleft()
            tag, b.next_tag = b.next_tag, b.next_tag + 1
            b.outstanding[tag] = mid
            message = Message(message_id=mid, body=b"", routing_key="q", exchange="")
            self.core.delivered(tag, message, redelivered=redelivered)
            self.carry_out(self.core)
        self.pump()  # once: the kit's pump runs after the deliveries of one read (call_soon)

    def run(self, k: int) -> None:
        if self.jobs:
            window = list(self.jobs)[k % len(self.jobs)]
            self.resume(window, *self.jobs.pop(window))

    def release(self, k: int) -> None:
        if self.blocked:
            window = list(self.blocked)[k % len(self.blocked)]
            self.resume(window, *self.blocked.pop(window))

    def resume(self, window: Window, core: KitCore, job: Job) -> None:
        try:
            next(job)
        except StopIteration as done:
            core.job_done(window, done.value)
            self.after(core)
        except Crash:
            self.crash()
            self.pump()
        else:
            self.blocked[window] = (core, job)

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.core.tick()
        self.after(self.core)

    def database(self, up: bool) -> None:
        self.disruptions += int(self.db.up and not up)
        self.db.up = up

    # ------------------------------------------------------------ the jobs (app.consumer.work)

    def job(self, lane: str, window: Window) -> Job:
        if lane == "window":
            return self.window_job(window)
        return self.single_job(window, charge=lane == "suspect")

    def behaviour(self, mid: str) -> Behaviour:
        plan = self.plans.get(mid)
        return plan.popleft() if plan else "ok"

    def handler(
        self, window: Window, mid: str, behaviour: Behaviour
    ) -> Generator[None, None, bool]:
        """Run a handler; False when it raised."""
        if behaviour == "crash":
            self.faults[mid] += 1
            raise Crash(mid)
        if behaviour == "hang":
            yield  # until released; the core may cut or time it out meanwhile
        if behaviour == "raise" and self.db.up and not window.abandoned:
            self.faults[mid] += 1
        return behaviour != "raise"

    def window_job(self, window: Window) -> Job:
        out = Outcome()
        if not self.db.up:
            out.outage, out.again = DatabaseDown(), list(window.items)
            return out
        taken: list[Held] = []
        new: dict[str, Held] = {}
        if self.batch_handler:
            taken.extend(window.take_all())
            for item in taken:
                if item.message_id in new:
                    out.deduplicated.append(item)
                else:
                    new[item.message_id] = item
            peek = {self.plans[m][0] for m in new if self.plans.get(m)}
            if "crash" in peek:
                raise Crash("a batch")
            if "hang" in peek:
                yield
            if "raise" in peek:
                window.done_running()
                out.deduplicated.clear()
                return self.window_failed(window, out, taken, None)
        while (held := window.take()) is not None:
            taken.append(held)
            if held.message_id in new:
                out.deduplicated.append(held)
                continue
            ok = yield from self.handler(window, held.message_id, self.behaviour(held.message_id))
            if not ok:
                window.done_running()
                out.deduplicated.clear()
                return self.window_failed(window, out, taken, held)
            new[held.message_id] = held
        window.done_running()
        return self.commit_window(window, out, taken, new)

    def commit_window(
        self, window: Window, out: Outcome, taken: list[Held], new: dict[str, Held]
    ) -> Outcome:
        rest = window.untaken()
        if not self.db.up:
            out.deduplicated.clear()
            return self.window_failed(window, out, taken, None)
        inserted = {m for m in new if m not in self.db.inbox}
        if len(inserted) < len(new):
            out.deduplicated = [h for h in new.values() if h.message_id not in inserted]
            again = set(map(id, out.deduplicated))
            out.again = [h for h in taken if id(h) not in again] + rest
            return out
        if not window.begin_commit():
            out.deduplicated.clear()
            out.abandoned, out.again = True, taken + rest
            return out
        self.db.commit(list(new))
        if self.db.lose_commit_reply:
            self.db.lose_commit_reply = False
            for held in new.values():
                held.maybe_committed = True
            out.deduplicated.clear()
            out.outage, out.again = DatabaseDown("the COMMIT's reply"), taken + rest
            return out
        out.handled, out.again = list(new.values()), rest
        return out

    def window_failed(
        self, window: Window, out: Outcome, taken: list[Held], culprit: Held | None
    ) -> Outcome:
        others = [h for h in taken if h is not culprit] + window.untaken()
        blamed = [culprit] if culprit else []
        if window.abandoned:
            out.abandoned, out.again = True, [*others, *blamed]
        elif not self.db.up:
            out.outage, out.again = DatabaseDown(), [*blamed, *others]
        elif culprit is None and len(taken) == 1:  # a batch handler of one message raised
            self.faults[taken[0].message_id] += 1
            self.behaviour(taken[0].message_id)
            return self.window_failed(window, out, taken, taken[0])
        elif culprit is None:
            out.isolate = others
        else:
            culprit.failure = "raised"
            out.failed.append(culprit)
            out.again = others
        return out

    def single_job(self, window: Window, *, charge: bool) -> Job:
        out = Outcome()
        held = window.items[0]
        mid = held.message_id
        if not self.db.up:
            out.outage, out.again = DatabaseDown(), [held]
            return out
        if held.failure is not None:
            return self.record_failure(held, out)
        if charge and not held.charged:
            if mid in self.db.inbox:
                out.deduplicated.append(held)
                return out
            before = self.db.charge(mid) - 1
            held.charged, held.attempts = True, before
            verdict = limit_verdict(before, self.cfg.delivery_limit, self.db.attempts[mid][1])
            if verdict is not None:
                self.db.attempts.pop(mid)
                return self.dead(held, verdict, out)
        if window.take() is None:
            out.abandoned, out.again = True, list(window.items)
            return out
        if mid in self.db.inbox:
            window.done_running()
            out.deduplicated.append(held)
            return out
        ok = yield from self.handler(window, mid, self.behaviour(mid))
        window.done_running()
        if not ok:
            if window.abandoned:
                out.abandoned, out.again = True, [held]
            elif not self.db.up:
                out.outage, out.again = DatabaseDown(), [held]
            else:
                held.failure = "raised"
                return self.record_failure(held, out)
            return out
        if not window.begin_commit():
            out.abandoned, out.again = True, [held]
            return out
        if mid in self.db.inbox:
            # another transaction recorded it meanwhile: on the database this one's inbox row
            # waited on that one's, then found it (the order differs, the outcome does not)
            out.deduplicated.append(held)
            return out
        if not self.db.up or self.db.lose_commit_reply:
            if self.db.up:
                self.db.lose_commit_reply = False
                self.db.commit([mid])
                self.db.attempts.pop(mid, None)
            held.maybe_committed = True
            out.outage, out.again = DatabaseDown("the COMMIT"), [held]
            return out
        self.db.commit([mid])
        self.db.attempts.pop(mid, None)
        out.handled.append(held)
        return out

    def record_failure(self, held: Held, out: Outcome) -> Outcome:
        mid, error = held.message_id, held.failure or "failed"
        if mid in self.db.inbox:  # its effect is done: not charged
            held.failure = None
            out.deduplicated.append(held)
            return out
        if held.charged:
            self.db.attempts[mid] = (self.db.attempts.get(mid, (1, None))[0], error)
            count = self.db.attempts[mid][0]
        else:
            count = self.db.charge(mid, error)
        held.attempts, held.charged = count, False
        verdict = limit_verdict(count, self.cfg.delivery_limit, error)
        if verdict is not None:
            self.db.attempts.pop(mid)
            return self.dead(held, verdict, out)
        held.failure = None
        self.verdicts["requeue"].append(mid)
        out.requeue.append(held)
        return out

    def dead(self, held: Held, verdict: str, out: Outcome) -> Outcome:
        held.failure = verdict
        self.verdicts["dead"].append(held.message_id)
        out.dead.append(held)
        return out

    # ------------------------------------------------------------ the end

    def settle(self, *, hangs_time_out: bool = False, rounds: int = 400) -> None:
        """Faults over: the database answers, hung handlers return (after their timeout, with
        ``hangs_time_out``). Everything must end."""
        self.database(True)
        self.db.lose_commit_reply = False
        for _ in range(rounds):
            if self.blocked:
                if hangs_time_out and any(w in self.core.jobs for w in self.blocked):
                    self.tick(TIMEOUT + 1)
                self.release(0)
            elif self.jobs:
                self.run(0)
            elif self.broker.ready and len(self.broker.outstanding) < self.broker.prefetch:
                self.deliver(self.broker.prefetch)
            elif self.broker.outstanding or self.broker.ready:
                self.tick(TIMEOUT + 1)  # past the outage's backoff and any handler's timeout
            else:
                return
        raise Broken(
            f"not settled after {rounds} rounds: {len(self.broker.ready)} ready, "
            f"{len(self.broker.outstanding)} outstanding, {len(self.core.held)} held"
        )

    def totals(self) -> tuple[int, int]:
        """The ``handled`` and ``dead_lettered`` metrics over every process so far."""
        m = self.state.metrics.counts
        return self.handled + m["handled"], self.dead_letter_metric + m["dead_lettered"]
