"""The consumer kit's decisions, without I/O: the receiving end's ``confirms.py``.

One :class:`KitCore` per channel holds what the kit decides: which deliveries it holds, which
job (a window of first deliveries, a message alone, a redelivered message charged first) runs
each, which tags to ack (``multiple`` over the finished head, :mod:`app.consumer.acks`), nack or
reject, when a message is given up (dead-lettered), and when the database is out (pause: one
probe at a time, backoff with jitter). What lives longer than a channel (the outage, the figures,
the hung jobs) is the consumer's :class:`KitState`.

The shell (:mod:`app.consumer.kit`) feeds it events and carries out the commands it returns
(:meth:`KitCore.take`), in order::

    events (methods)                          commands
    delivered(tag, message, redelivered=)     Start(lane, window)    run a job on a handler thread
    pump()                                    Frame(kind, tag, ...)  basic.ack/nack/reject, in order
    job_done(window, outcome), job_failed()   DeadLetter(held)       publish a copy, then report
    tick()  (time: cut slow windows, time out Abandoned(window)      a handler timed out: new
            hung handlers, retry after an outage)                    threads, cancel its statement
    dead_letter_sent(held) / _failed(held)    RetryAt(when)          the database is out: pump
    channel_closed(), close()                                        again then

Only this module and :mod:`app.consumer.work` (what a job does with the database) decide; the
shell moves frames and runs jobs. Pure: standard library only (``tests/unit/test_pure_imports``).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from app.consumer.acks import AckTracker
from app.consumer.config import CUT_AFTER, WINDOW_SECONDS, ConsumerConfig, ConsumerMetrics
from app.consumer.held import Held, Message, Outcome, Window
from app.logs import first_line

log = logging.getLogger("app.consumer")


class Outage:
    """The database is down: since when, and when to try again (backoff with jitter)."""

    def __init__(self, *, name: str, max_delay: float, rng: random.Random) -> None:
        self.name, self.max_delay, self.rng = name, max_delay, rng
        self.since: float | None = None
        self.delay = 0.0
        self.next_try = 0.0
        self.errors = 0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException, now: float) -> bool:
        """A database call failed; True when this starts an outage."""
        self.errors += 1
        started = self.since is None
        if started:
            self.since, self.delay = now, 0.2
        else:
            self.delay = min(self.max_delay, self.delay * 2)
        self.next_try = now + self.delay * (0.5 + self.rng.random() / 2)
        return started

    def recovered(self, now: float) -> float | None:
        """The database answered; the outage's length if one ends now."""
        if self.since is None:
            return None
        took, self.since, self.errors = now - self.since, None, 0
        return took


# ---------------------------------------------------------------- commands


Lane = Literal["window", "single", "suspect"]


@dataclass(frozen=True, slots=True)
class Start:
    """Run a job on a handler thread: a window in one transaction (``window``), a message alone
    (``single``), or a redelivered message charged before its handler runs (``suspect``)."""

    lane: Lane
    window: Window


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame to the broker, sent in the order decided: ``ack`` (``multiple`` settles every
    outstanding tag up to ``tag``; ``count`` deliveries), ``nack`` (requeue) or ``reject``."""

    kind: Literal["ack", "nack", "reject"]
    tag: int
    multiple: bool = False
    count: int = 1


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Publish a copy of ``held`` to the dead-letter exchange (the reason in its ``failure``),
    then report :meth:`KitCore.dead_letter_sent` (it is acked) or ``dead_letter_failed``."""

    held: Held


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A handler ran past its timeout: its thread keeps its slot (the next jobs need threads of
    their own) and a statement it waits on is to be cancelled."""

    window: Window


@dataclass(frozen=True, slots=True)
class RetryAt:
    """The database is out: pump again at ``when`` (the clock's time) for the next probe."""

    when: float


Command: TypeAlias = Start | Frame | DeadLetter | Abandoned | RetryAt


@dataclass(eq=False)
class KitState:
    """What outlives a channel: the config, the figures, the database outage, the jobs whose
    handler timed out and whose thread has not returned, and a handler's mean time."""

    config: ConsumerConfig
    metrics: ConsumerMetrics
    outage: Outage
    #: a batch handler handles windows (a timed-out window then runs one message at a time)
    batch_handler: bool = False
    clock: Callable[[], float] = time.monotonic
    abandoned: set[Window] = field(default_factory=set)
    #: a moving average of a handler's time in batched windows (sizes the windows)
    seconds_per_message: float = 0.0


class KitCore:
    """The deliveries of one channel: which job handles each, the outage pause, the acks."""

    def __init__(self, state: KitState) -> None:
        self.s = state
        self.cfg = state.config
        self.tracker = AckTracker()
        self.held: dict[int, Held] = {}
        self.fresh: deque[Held] = deque()  # first deliveries, in order
        self.singles: deque[Held] = deque()  # to run alone: failures to record, isolated ones
        self.suspects: deque[Held] = deque()  # redelivered: alone, one at a time, charged first
        self.jobs: dict[Window, Lane] = {}
        self.closed = False
        self.sending = True  # the channel is open: acks can go
        self._out: list[Command] = []

    def take(self) -> list[Command]:
        """The commands decided since the last call, in order."""
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ deliveries in

    def delivered(self, tag: int, message: Message, *, redelivered: bool) -> None:
        m = self.s.metrics
        m.add("deliveries")
        m.add("redelivered", int(redelivered))
        if self.closed:
            return  # a late delivery of a closed run: the broker gives it again
        self.tracker.received(tag)
        if not message.message_id:
            log.error(
                "delivery %d on %s has no message_id: cannot deduplicate, dead-lettered",
                tag,
                self.cfg.queue,
            )
            m.add("dead_lettered")
            self._frame("reject", tag)
            return
        count = delivery_count(message.headers, redelivered=redelivered)
        held = Held(
            tag=tag, message=message, redelivered=redelivered or count > 0, broker_count=count
        )
        self.held[tag] = held
        m.in_flight = len(self.held)
        self._route(held)

    def _route(self, held: Held, *, front: bool = False) -> None:
        lane = (
            self.singles
            if held.failure is not None
            else self.suspects
            if held.redelivered
            else self.fresh
        )
        if front:
            lane.appendleft(held)
        else:
            lane.append(held)

    def _again(self, helds: list[Held]) -> None:
        for held in reversed(helds):
            if held.tag in self.held:
                self._route(held, front=True)

    # ------------------------------------------------------------ jobs

    def pump(self) -> None:
        """Start jobs for what waits: ``concurrency`` windows or single messages at once, and
        the redelivered messages one at a time beside them; one probe at a time while the
        database is out."""
        if self.closed:
            return
        if self.s.outage.down:
            self._probe()
            return
        if self.suspects and not any(lane == "suspect" for lane in self.jobs.values()):
            self._start("suspect", [self.suspects.popleft()])
        busy = sum(lane != "suspect" for lane in self.jobs.values())
        while busy < self.cfg.concurrency and (self.singles or self.fresh):
            if self.singles:
                self._start("single", [self.singles.popleft()])
            elif self.cfg.mode == "message":
                self._start("single", [self.fresh.popleft()])
            elif len(self.fresh) >= self.window_size or not self._windows_moving():
                take = min(self.window_size, len(self.fresh))
                self._start("window", [self.fresh.popleft() for _ in range(take)])
            else:
                break  # a window is under way: let the next one fill (fewer, larger commits)
            busy += 1

    def _probe(self) -> None:
        """The database is out: one delivery at a time, once its backoff has passed."""
        if self.jobs or self.s.clock() < self.s.outage.next_try:
            return
        fresh: Lane = "single" if self.cfg.mode == "message" else "window"
        lanes: tuple[tuple[Lane, deque[Held]], ...] = (
            ("single", self.singles),
            ("suspect", self.suspects),
            (fresh, self.fresh),
        )
        for lane, queue in lanes:
            if queue:
                self._start(lane, [queue.popleft()])
                return

    @property
    def window_size(self) -> int:
        """``batch_size``, but at most half the prefetch (a window held up by a slow handler
        must leave the broker room to send the others more deliveries), and no more than the
        handlers get through in about :data:`WINDOW_SECONDS` (slow handlers: smaller windows,
        spread over the threads)."""
        most = max(1, min(self.cfg.batch_size, self.cfg.prefetch // 2))
        per = self.s.seconds_per_message
        return most if per <= 0 else max(1, min(most, int(WINDOW_SECONDS / per)))

    def _windows_moving(self) -> bool:
        """A window is running whose handler is not slow (it will be done soon)."""
        now = self.s.clock()
        for window, lane in self.jobs.items():
            running = window.running
            if lane == "window" and (running is None or now - running[1] <= CUT_AFTER):
                return True
        return False

    def _start(self, lane: Lane, items: list[Held]) -> None:
        window = Window(items, clock=self.s.clock)
        self.jobs[window] = lane
        self._out.append(Start(lane, window))

    # ------------------------------------------------------------ outcomes

    def job_done(self, window: Window, out: Outcome | None) -> None:
        """A job returned ``out`` (None: it was cancelled)."""
        if self._forget(window) and out is not None:
            self._apply(window, out)

    def job_failed(self, window: Window, error: BaseException) -> None:
        """A job raised: a bug of the kit. Its deliveries are requeued (the inbox absorbs those
        done)."""
        if not self._forget(window):
            return
        log.error(
            "the consumer kit failed on %d deliveries: requeued", len(window.items), exc_info=error
        )
        for held in window.items:
            self._settle(held, requeue=True)
        self._after()

    def _forget(self, window: Window) -> bool:
        """The job of ``window`` is over; False when its outcome no longer counts (it timed out:
        its deliveries were dealt with then)."""
        if window in self.s.abandoned:
            self.s.abandoned.discard(window)
            self.s.metrics.abandoned_handlers = len(self.s.abandoned)
            return False
        self.jobs.pop(window, None)
        return True

    def _apply(self, window: Window, out: Outcome) -> None:
        m = self.s.metrics
        if out.handled or out.failed or out.dead or out.requeue:
            m.add("transactions")
        self._observe(window, out)
        for held in out.handled:
            self._finish(held, "handled")
        for held in out.deduplicated:  # a commit whose reply was lost did commit
            self._finish(held, "handled" if held.maybe_committed else "deduplicated")
        for held in out.failed:
            m.add("handler_failures")
            self._route(held)
        for held in out.requeue:
            log.warning(
                "handler failed on %s (attempt %d of %d): requeued",
                held.message_id,
                held.attempts,
                self.cfg.delivery_limit,
            )
            self._settle(held, requeue=True)
        for held in out.dead:
            self._dead_letter(held)
        self._again(out.again)
        for held in out.isolate:
            if held.tag in self.held:
                self.singles.append(held)
        if out.outage is not None and self.closed:
            # a job of a channel gone: its deliveries come back on the next one, whose jobs see
            # the database as it is (an outage started here would wait for a probe that an
            # idle channel never starts)
            self.s.metrics.add("database_errors")
        elif out.outage is not None:
            self._database_failed(out.outage)
        elif not out.abandoned:
            self._database_answered()
        self._after()

    def _observe(self, window: Window, out: Outcome) -> None:
        """Latency of what is done, and a handler's mean time (it sizes the next windows)."""
        s = self.s
        done = len(out.handled) + len(out.deduplicated)
        if not done:
            return
        s.metrics.handler_seconds.observe_many(s.clock() - window.created, done)
        if out.handled and out.handler_seconds:
            per = out.handler_seconds / len(out.handled)
            before = s.seconds_per_message
            s.seconds_per_message = per if before <= 0 else (0.8 * before + 0.2 * per)

    def _after(self) -> None:
        self.s.metrics.in_flight = len(self.held)
        self.flush()

    # ------------------------------------------------------------ the database out

    def _database_failed(self, exc: BaseException) -> None:
        s, m = self.s, self.s.metrics
        m.add("database_errors")
        if s.outage.failed(exc, s.clock()):
            m.add("database_outages")
            m.database_down = True
            log.warning(
                "consumer %s: the database does not answer (%s): consumption paused, %d "
                "deliveries held and retried with backoff; none counts against its delivery "
                "limit",
                self.cfg.name,
                first_line(exc),
                len(self.held),
            )
        self._out.append(RetryAt(s.outage.next_try))

    def _database_answered(self) -> None:
        s = self.s
        took = s.outage.recovered(s.clock())
        if took is not None:
            s.metrics.database_down = False
            s.metrics.add("reconnects")
            log.info(
                "consumer %s: the database answers again after %.1fs: consuming",
                self.cfg.name,
                took,
            )

    # ------------------------------------------------------------ settling

    def _finish(self, held: Held, counter: str) -> None:
        self.s.metrics.add(counter)
        if self.held.pop(held.tag, None) is not None:
            self.tracker.finished(held.tag)

    def _settle(self, held: Held, *, requeue: bool) -> None:
        if self.held.pop(held.tag, None) is None:
            return
        self.s.metrics.add("requeued" if requeue else "dead_lettered")
        self._frame("nack" if requeue else "reject", held.tag)

    def _dead_letter(self, held: Held) -> None:
        log.error("consumer %s dead-letters %s: %s", self.cfg.name, held.message_id, held.failure)
        if held.broker_limited:
            self.s.metrics.add("broker_limited")
        if self.cfg.dead_letter_exchange is None:
            self._settle(held, requeue=False)
        elif self.held.pop(held.tag, None) is not None:
            self.s.metrics.add("dead_lettered")
            self._out.append(DeadLetter(held))

    def dead_letter_sent(self, held: Held) -> None:
        """The dead letter's copy is confirmed: the delivery is acked."""
        self.tracker.finished(held.tag)
        self.flush()

    def dead_letter_failed(self, held: Held) -> None:
        """The copy could not be published: rejected (the queue's own dead-letter exchange, if
        any, takes it)."""
        self._frame("reject", held.tag)

    def _frame(self, kind: Literal["nack", "reject"], tag: int) -> None:
        self.tracker.settled(tag)
        self._out.append(Frame(kind, tag))

    def flush(self) -> None:
        """Ack every finished delivery (nothing once the channel is gone: the broker gives them
        again, the inbox absorbs them)."""
        if self.closed or not self.sending:
            return
        for ack in self.tracker.acks(multiple=self.cfg.ack_multiple):
            self._out.append(Frame("ack", ack.tag, ack.multiple, ack.count))

    # ------------------------------------------------------------ time

    def tick(self) -> None:
        """Cut windows whose handler is slow, fail handlers past their timeout."""
        now = self.s.clock()
        limit = self.cfg.handler_timeout
        for window, lane in list(self.jobs.items()):
            running = window.running
            if running is None:
                continue
            held, started = running
            if limit is not None and now - started > limit and window.abandon():
                self._abandon(window)
                if lane == "window" and self.s.batch_handler:
                    self._batch_timed_out(window, now - started)
                else:
                    self._timed_out(window, held, now - started)
            elif lane == "window" and now - started > CUT_AFTER:
                self._again(window.cut())
        self.flush()

    def _abandon(self, window: Window) -> None:
        self.jobs.pop(window, None)
        self.s.abandoned.add(window)
        self.s.metrics.abandoned_handlers = len(self.s.abandoned)
        self._out.append(Abandoned(window))

    def _timed_out(self, window: Window, held: Held, took: float) -> None:
        m = self.s.metrics
        m.add("handler_timeouts")
        m.add("handler_failures")
        log.error(
            "consumer %s: the handler of %s ran past %.0fs: its attempt failed; the "
            "thread is left to return on its own",
            self.cfg.name,
            held.message_id,
            took,
        )
        held.failure = f"the handler ran past handler_timeout ({self.cfg.handler_timeout:g}s)"
        self._again([h for h in window.items if h is not held])
        if held.tag in self.held:
            self._route(held, front=True)
        self._after()

    def _batch_timed_out(self, window: Window, took: float) -> None:
        """A batch handler ran past the timeout: which message hangs is unknown, so none is
        charged; they run again one at a time, where the one that hangs fails alone."""
        log.warning(
            "consumer %s: a batch handler ran past %.0fs over %d messages: they run "
            "again one at a time",
            self.cfg.name,
            took,
            len(window.items),
        )
        for held in window.items:
            if held.tag in self.held:
                self.singles.append(held)
        self._after()

    # ------------------------------------------------------------ end

    def channel_closed(self) -> None:
        """The channel is gone: no more acks (its tags mean nothing on the next one)."""
        self.sending = False

    def close(self) -> None:
        self.closed = True
        self.fresh.clear()
        self.singles.clear()
        self.suspects.clear()


# ---------------------------------------------------------------- verdicts: when to give up


def limit_verdict(attempts: int, limit: int, last_error: str | None) -> str | None:
    """Why a message is dead-lettered once ``attempts`` of its tries ended without an effect
    (raised, timed out, or never returned: its process died, its database went away while it
    ran); None below ``limit`` (it is requeued, or its handler runs)."""
    if attempts < limit:
        return None
    last = (
        f"failed: {last_error}"
        if last_error
        else "ended without an outcome (the consumer died or lost its database while the "
        "handler ran)"
    )
    return f"delivery limit {limit} reached: {attempts} attempts, the last {last}"


def broker_verdict(broker_count: int, broker_limit: int | None) -> str | None:
    """Why a redelivery is dead-lettered before its handler runs: a quorum queue's
    ``x-delivery-count`` (``broker_count``) reached ``broker_limit``; None below it."""
    if broker_limit is None or broker_count < broker_limit:
        return None
    return (
        f"broker delivery limit {broker_limit} reached: the broker returned it "
        f"{broker_count} times (x-delivery-count)"
    )


def delivery_count(headers: Mapping[str, Any], *, redelivered: bool) -> int:
    """A quorum queue's ``x-delivery-count`` header (absent on a first delivery and on classic
    queues): how often the broker had this message back before. Trusted only on a delivery the
    broker flags ``redelivered``: on a first one the header can only be the producer's (a
    quorum queue adds it from the second delivery on, overwriting any), and a producer's
    ``x-delivery-count: 999`` once dead-lettered a message before its handler ever ran."""
    if not redelivered:
        return 0
    value = headers.get("x-delivery-count")
    return value if isinstance(value, int) and value > 0 else 0
