"""The consumer kit: manual acks, a per-consumer prefetch, an inbox, a failure policy.

::

    broker ──deliveries (≤ prefetch unacked)──▶ Consumer ──windows──▶ handler threads
           ◀── acks as soon as committed (multiple over the finished head) ──┘  (inbox + effects,
           ◀── nack/requeue, or dead-letter at the delivery limit                one COMMIT)

- ``basic.qos(prefetch)`` on the consumer's own channel: RabbitMQ's per-consumer limit, so at most
  ``prefetch`` deliveries are in the kit's hands (in handlers or awaiting their ack).
- **Batched** (the default mode): first deliveries are handled in windows of up to
  ``batch_size``, ``concurrency`` windows at a time, each in one transaction
  (:func:`~app.consumer.work.run_window`). **Per message** (``mode="message"``): each delivery in
  a transaction of its own, for handlers whose effect lies outside the database.
- Every finished delivery is acknowledged as soon as its transaction committed, even while an
  older one still runs (:class:`~app.consumer.acks.AckTracker`): a slow handler holds only its
  own delivery (and those that ran before it in its window). A window whose handler is slow is
  cut: the deliveries it had not started go to another window.
- A handler that raises: its message's attempt is counted (``outbox_consumer_attempts``) and it
  is requeued, or dead-lettered once it failed ``delivery_limit`` times. A handler running past
  ``handler_timeout`` counts as a failure of its message. A **redelivered** message runs alone,
  one at a time, with its attempt counted *before* its handler runs: a message that kills the
  process is dead-lettered after the limit, and only the message that was running is charged.
- The database failing (refused, reset, gone) is not a failing message: the kit stops taking
  deliveries into handlers, keeps what it holds, retries the same deliveries with backoff and
  jitter, counts nothing against them, and is not ready meanwhile. One WARNING when it starts,
  one INFO with its duration when it ends.
- The broker cancels the consumer (queue deleted), or the channel or connection is lost: the kit
  logs it, reconnects with backoff; unacked deliveries come again and the inbox absorbs the ones
  whose effect was done.
- Graceful stop: cancel the consumer, let what is held finish within ``stop_timeout``, ack it,
  close.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import aio_pika
from aio_pika.abc import AbstractChannel
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic as spec_basic
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Engine

from app.consumer.acks import AckTracker
from app.consumer.inbox import ERROR_CHARS, BatchHandler, Handler, Message
from app.consumer.work import Held, Outcome, Window, run_single, run_window
from app.db import make_engine
from app.histogram import Histogram
from app.logs import redact_url

log = logging.getLogger("app.consumer")


def pool_size(engine: Engine) -> int | None:
    """How many connections ``engine`` keeps open between uses (None: a pool without that bound)."""
    size = getattr(engine.pool, "size", None)
    return int(size()) if callable(size) else None


def consumer_engine(url: str, *, concurrency: int, **kwargs: Any) -> Engine:
    """An engine for a consumer with ``concurrency`` handler threads: one kept connection per
    thread, and one for the lane of redelivered messages. With fewer, each thread beyond the pool
    opens a new database session per job and closes it after. No ping before each use: a
    connection that broke fails its job, which the kit retries as a database outage."""
    kwargs.setdefault("pool_size", max(5, concurrency + 1))
    kwargs.setdefault("pool_pre_ping", False)
    # every job ends its transaction itself (commit, or rollback on any error), and closing a
    # connection rolls back one left open: the pool's own ROLLBACK on return is a round trip
    # per transaction for nothing
    kwargs.setdefault("pool_reset_on_return", None)
    return make_engine(url, **kwargs)


COUNTERS = {
    "deliveries": "Deliveries received (redeliveries included).",
    "redelivered": "Deliveries the broker flagged as redelivered.",
    "handled": "Messages whose handler ran and committed (effect done).",
    "deduplicated": "Deliveries already in the inbox: acked without running the handler.",
    "acked": "Deliveries acknowledged.",
    "ack_frames": "basic.ack frames sent (each may settle many deliveries).",
    "transactions": "Transactions that ran handlers (a window of deliveries, or one message).",
    "handler_failures": "Handlers that raised or ran past handler_timeout (each an attempt).",
    "handler_timeouts": "Handlers that ran past handler_timeout (counted as failed attempts).",
    "requeued": "Failed deliveries requeued (below the delivery limit).",
    "dead_lettered": "Deliveries dead-lettered (delivery limit reached, or no message_id).",
    "broker_limited": "Deliveries dead-lettered because a quorum queue's x-delivery-count "
    "reached broker_delivery_limit.",
    "database_errors": "Database calls that failed (each retried, none against a message).",
    "database_outages": "Times consumption paused because the database stopped answering.",
    "cancels": "Consumers cancelled by the broker (queue deleted).",
    "reconnects": "Connections lost and opened again (the broker's, and the database's after an "
    "outage).",
}
LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: A window whose running handler has taken this long gives the deliveries it has not started
#: to another window.
CUT_AFTER = 0.25
#: A window holds about this much handler time at most: slow handlers get smaller windows,
#: spread over the handler threads (fast ones fill ``batch_size``).
WINDOW_SECONDS = 0.2


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    name: str  # the inbox key: consumers of the same name share effects
    queue: str
    #: ``batch``: windows of first deliveries in one transaction each; ``message``: a
    #: transaction per message (for handlers whose effect is outside the database)
    mode: Literal["batch", "message"] = "batch"
    prefetch: int = 400
    concurrency: int = 8
    #: deliveries per window at most (and at most half the prefetch)
    batch_size: int = 200
    delivery_limit: int = 5
    #: a quorum queue's ``x-delivery-count`` at or above this dead-letters the delivery (with
    #: the kit's headers) before its handler runs: the broker's count sees tries the attempts
    #: table cannot, but it also counts every delivery a crash returned, so keep it well above
    #: ``delivery_limit`` and below the queue's ``x-delivery-limit`` (None: not used)
    broker_delivery_limit: int | None = 50
    #: a handler running longer fails its message's attempt (None: no limit)
    handler_timeout: float | None = 60.0
    ack_interval: float = 0.05
    #: one basic.ack(multiple) per finished run (default), or one ack per delivery
    ack_multiple: bool = True
    stop_timeout: float = 10.0
    reconnect_max_delay: float = 10.0
    #: the longest pause between two tries while the database is down
    database_retry_max_delay: float = 10.0
    #: dead letters are published here (with headers saying why) and the delivery acked; None:
    #: rejected without requeue (the queue's own x-dead-letter-exchange, if any, takes them)
    dead_letter_exchange: str | None = None
    #: routing key for ``dead_letter_exchange`` (None: the message's own routing key)
    dead_letter_routing_key: str | None = None

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be at least 1"
            for name, value in (
                ("prefetch", self.prefetch),
                ("concurrency", self.concurrency),
                ("delivery_limit", self.delivery_limit),
                ("batch_size", self.batch_size),
            )
            if value < 1
        ]
        if not self.name.strip() or not self.queue.strip():
            problems.append("name and queue must not be empty")
        if self.mode not in ("batch", "message"):
            problems.append(f"mode must be 'batch' or 'message', not {self.mode!r}")
        if self.handler_timeout is not None and self.handler_timeout <= 0:
            problems.append("handler_timeout must be positive (or None)")
        if self.broker_delivery_limit is not None and self.broker_delivery_limit < 1:
            problems.append("broker_delivery_limit must be at least 1 (or None)")
        if problems:
            raise ValueError("invalid consumer config: " + "; ".join(problems))


@dataclass
class ConsumerMetrics:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    handler_seconds: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS))
    in_flight: int = 0
    prefetch: int = 0
    connected: bool = False
    database_down: bool = False
    #: when the oldest handler still running started (monotonic), abandoned ones included
    oldest_handler_started: Callable[[], float | None] = lambda: None
    abandoned_handlers: int = 0

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def oldest_handler_seconds(self) -> float:
        started = self.oldest_handler_started()
        return 0.0 if started is None else max(0.0, time.monotonic() - started)


class ConsumerCollector(Collector):
    def __init__(self, metrics: ConsumerMetrics, *, consumer: str) -> None:
        self.m, self.label = metrics, [consumer]

    def collect(self) -> Any:
        for name, doc in COUNTERS.items():
            fam = CounterMetricFamily(f"outbox_consumer_{name}", doc, labels=["consumer"])
            fam.add_metric(self.label, self.m.counts[name])
            yield fam
        for name, value, doc in (
            ("in_flight", self.m.in_flight, "Deliveries held (in a handler or awaiting an ack)."),
            ("prefetch", self.m.prefetch, "The consumer's prefetch (basic.qos)."),
            ("connected", int(self.m.connected), "1 while consuming."),
            (
                "database_down",
                int(self.m.database_down),
                "1 while consumption is paused because the database does not answer.",
            ),
            (
                "oldest_handler_seconds",
                self.m.oldest_handler_seconds(),
                "Age of the oldest handler still running (0 when none runs).",
            ),
            (
                "abandoned_handlers",
                self.m.abandoned_handlers,
                "Handlers past their timeout whose thread has not returned yet.",
            ),
        ):
            gauge = GaugeMetricFamily(f"outbox_consumer_{name}", doc, labels=["consumer"])
            gauge.add_metric(self.label, value)
            yield gauge
        hist = HistogramMetricFamily(
            "outbox_consumer_handler_seconds",
            "Time from a delivery's handling start to its commit (its window's, when batched).",
            labels=["consumer"],
        )
        hist.add_metric(
            self.label, self.m.handler_seconds.cumulative(), sum_value=self.m.handler_seconds.sum
        )
        yield hist


def registry_for(metrics: ConsumerMetrics, *, consumer: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConsumerCollector(metrics, consumer=consumer))
    return registry


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


class _Lost(Exception):
    """The consumer must start over on a new connection (cancelled, channel or connection lost)."""


class Consumer:
    """Consumes one queue into ``handler`` with an inbox; :meth:`run` until ``stop`` is set."""

    def __init__(
        self,
        *,
        config: ConsumerConfig,
        amqp_url: str,
        engine: Engine,
        handler: Handler | None = None,
        batch_handler: BatchHandler | None = None,
        metrics: ConsumerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (handler is None) == (batch_handler is None):
            raise ValueError("give the consumer a handler or a batch_handler (one of them)")
        self.config = config
        self.amqp_url = amqp_url
        self.engine = engine
        self.batch_handler = batch_handler
        self.handler: Handler = handler or _one_at_a_time(batch_handler)
        self.metrics = metrics or ConsumerMetrics()
        self.metrics.prefetch = config.prefetch
        self.metrics.oldest_handler_started = self._oldest_handler_started
        self.clock = clock
        self._rng = random.Random()
        self.outage = Outage(
            name=config.name, max_delay=config.database_retry_max_delay, rng=self._rng
        )
        self.pool = self._new_pool()
        #: windows whose handler ran past its timeout and whose thread has not returned
        self.abandoned: set[Window] = set()
        self._runs: list[_Run] = []
        #: a moving average of a handler's time in batched windows (sizes the windows)
        self.seconds_per_message = 0.0
        kept = pool_size(engine)
        if kept is not None and kept < config.concurrency:
            log.warning(
                "consumer %s: the database engine keeps %d connections for %d handler threads: "
                "the others open and close a connection per transaction (a new database "
                "session each, several times the CPU per message); make the engine with "
                "pool_size >= %d (consumer_engine)",
                config.name,
                kept,
                config.concurrency,
                config.concurrency,
            )

    def _new_pool(self) -> ThreadPoolExecutor:
        # the handler threads, and one for the lane of redelivered messages
        return ThreadPoolExecutor(self.config.concurrency + 1, thread_name_prefix="outbox-consumer")

    def ready(self) -> tuple[bool, dict[str, object]]:
        """Consuming, the database answering, and no handler running past its timeout."""
        oldest = self.metrics.oldest_handler_seconds()
        limit = self.config.handler_timeout
        details: dict[str, object] = {
            "consumer": self.config.name,
            "connected": self.metrics.connected,
            "database_down": self.outage.down,
            "oldest_handler_seconds": round(oldest, 3),
        }
        ok = self.metrics.connected and not self.outage.down and (limit is None or oldest <= limit)
        return ok, details

    def _oldest_handler_started(self) -> float | None:
        starts = [w.running[1] for w in self._windows() if w.running is not None]
        return min(starts, default=None)

    def _windows(self) -> list[Window]:
        return [*self.abandoned, *(w for run in self._runs for w in run.jobs)]

    async def run(self, stop: asyncio.Event) -> None:
        delay = 0.2
        try:
            while not stop.is_set():
                try:
                    await self._session(stop)
                    delay = 0.2
                except (_Lost, aio_pika.exceptions.AMQPError, OSError, TimeoutError) as exc:
                    self.metrics.connected = False
                    if stop.is_set():
                        break
                    self.metrics.add("reconnects")
                    wait = delay * (0.5 + self._rng.random() / 2)
                    log.warning(
                        "consumer %s on %s: %s; consuming again in %.1fs",
                        self.config.name,
                        self.config.queue,
                        exc or type(exc).__name__,
                        wait,
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
                    delay = min(self.config.reconnect_max_delay, delay * 2)
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            c = self.metrics.counts
            log.info(
                "consumer %s stopped: %d handled, %d deduplicated, %d dead-lettered, %d requeued",
                self.config.name,
                c["handled"],
                c["deduplicated"],
                c["dead_lettered"],
                c["requeued"],
            )

    # ------------------------------------------------------------ one connection

    async def _session(self, stop: asyncio.Event) -> None:
        cfg = self.config
        conn = await aio_pika.connect(  # named: operators (and tests) find it in the broker
            self.amqp_url,
            timeout=10,
            client_properties={"connection_name": f"outbox-consumer {cfg.name}"},
        )
        async with conn:
            channel = await conn.channel()
            await channel.set_qos(prefetch_count=cfg.prefetch)
            queue = await channel.get_queue(cfg.queue, ensure=True)
            dead_letters = None
            if cfg.dead_letter_exchange is not None:
                dead_letters = await conn.channel(publisher_confirms=True)
            lost = asyncio.Event()
            why: list[str] = []

            def on_cancel(frame: Any) -> None:
                self.metrics.add("cancels")
                tag = getattr(frame, "consumer_tag", None)
                why.append(f"the broker cancelled consumer {tag} (queue {cfg.queue} deleted?)")
                lost.set()

            def on_close(*args: Any) -> None:
                why.append(f"channel closed: {args[-1] if args else 'unknown'}")
                lost.set()

            underlay = await channel.get_underlay_channel()
            underlay.on_consumer_cancel_callbacks.add(on_cancel)
            channel.close_callbacks.add(on_close)
            run = _Run(self, channel, underlay, dead_letters)
            self._runs.append(run)
            try:
                # aiormq's delivery as it is: aio-pika's IncomingMessage adds an object and a
                # task per delivery on the event loop, which is the kit's bottleneck (the
                # consume figures in docs/consumer.md)
                tag = (await underlay.basic_consume(queue.name, run.on_delivery)).consumer_tag or ""

                self.metrics.connected = True
                log.info(
                    "consumer %s consuming %s from %s (%s mode, prefetch %d, %d handler threads)",
                    cfg.name,
                    cfg.queue,
                    redact_url(self.amqp_url),
                    cfg.mode,
                    cfg.prefetch,
                    cfg.concurrency,
                )
                ticker = asyncio.create_task(run.tick_forever())
                sender = asyncio.create_task(run.send_forever())
                stopping = asyncio.create_task(stop.wait())
                broken = asyncio.create_task(lost.wait())
                try:
                    await asyncio.wait([stopping, broken], return_when=asyncio.FIRST_COMPLETED)
                    if stop.is_set() and not lost.is_set():
                        with contextlib.suppress(Exception):
                            await underlay.basic_cancel(tag)
                        await run.drain(timeout=cfg.stop_timeout)
                finally:
                    run.close()
                    for task in (ticker, sender, stopping, broken):
                        task.cancel()
                    self.metrics.connected = False
            finally:
                if not run.jobs:  # else its jobs still report, and it goes when they are done
                    self._runs.remove(run)
            if lost.is_set() and not stop.is_set():
                raise _Lost("; ".join(why) or "consumer lost")


Lane = Literal["window", "single", "suspect"]


class _Run:
    """The deliveries of one channel: which job handles each, the database outage, the acks."""

    def __init__(
        self,
        consumer: Consumer,
        channel: AbstractChannel,
        underlay: Any,
        dead_letters: AbstractChannel | None,
    ) -> None:
        self.c = consumer
        self.cfg = consumer.config
        self.channel = channel
        self.underlay = underlay
        self.dead_letters = dead_letters
        self.tracker = AckTracker()
        self.held: dict[int, Held] = {}
        self.fresh: deque[Held] = deque()  # first deliveries, in order
        self.singles: deque[Held] = deque()  # to run alone: failures to record, isolated ones
        self.suspects: deque[Held] = deque()  # redelivered: alone, one at a time, charged first
        self.jobs: dict[Window, Lane] = {}
        self.closed = False
        self._pump_scheduled = False
        self._sends: set[asyncio.Task[None]] = set()
        self._frames: deque[tuple[str, int, bool, int]] = deque()
        self._wake = asyncio.Event()
        self._sent = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._settled = asyncio.Event()

    # ------------------------------------------------------------ deliveries in

    async def on_delivery(self, delivered: DeliveredMessage) -> None:
        deliver = delivered.delivery
        assert isinstance(deliver, spec_basic.Deliver) and deliver.delivery_tag is not None
        tag = deliver.delivery_tag
        m = self.c.metrics
        m.add("deliveries")
        redelivered = bool(deliver.redelivered)
        m.add("redelivered", int(redelivered))
        if self.closed:
            return  # a late delivery of a closed run: the broker gives it again
        self.tracker.received(tag)
        props = delivered.header.properties
        mid = props.message_id
        if not mid:
            log.error(
                "delivery %d on %s has no message_id: cannot deduplicate, dead-lettered",
                tag,
                self.cfg.queue,
            )
            m.add("dead_lettered")
            self._reject(tag)
            return
        message = Message(
            message_id=mid,
            body=delivered.body,
            routing_key=deliver.routing_key or "",
            exchange=deliver.exchange or "",
            headers=dict(props.headers or {}),
            content_type=props.content_type,
            redelivered=redelivered,
        )
        count = _delivery_count(message.headers, redelivered=redelivered)
        held = Held(
            tag=tag, message=message, redelivered=redelivered or count > 0, broker_count=count
        )
        self.held[tag] = held
        m.in_flight = len(self.held)
        self._route(held)
        self._schedule_pump()

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

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and not self.closed:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Start jobs for what waits: ``concurrency`` windows or single messages at once, and
        the redelivered messages one at a time beside them; one probe at a time while the
        database is down."""
        self._pump_scheduled = False
        if self.closed:
            return
        outage = self.c.outage
        if outage.down:
            if not self.jobs and self.c.clock() >= outage.next_try:
                fresh: Lane = "single" if self.cfg.mode == "message" else "window"
                lanes: tuple[tuple[Lane, deque[Held]], ...] = (
                    ("single", self.singles),
                    ("suspect", self.suspects),
                    (fresh, self.fresh),
                )
                for lane, queue in lanes:
                    if queue:
                        self._start(lane, [queue.popleft()])
                        break
            return
        if self.suspects and not any(lane == "suspect" for lane in self.jobs.values()):
            self._start("suspect", [self.suspects.popleft()])
        busy = sum(lane != "suspect" for lane in self.jobs.values())
        while busy < self.cfg.concurrency and (self.singles or self.fresh):
            if self.singles:
                self._start("single", [self.singles.popleft()])
            elif self.cfg.mode == "message":
                self._start("single", [self.fresh.popleft()])
            elif len(self.fresh) >= self._window_size or not self._windows_moving():
                take = min(self._window_size, len(self.fresh))
                self._start("window", [self.fresh.popleft() for _ in range(take)])
            else:
                break  # a window is under way: let the next one fill (fewer, larger commits)
            busy += 1

    @property
    def _window_size(self) -> int:
        """``batch_size``, but at most half the prefetch (a window held up by a slow handler
        must leave the broker room to send the others more deliveries), and no more than the
        handlers get through in about :data:`WINDOW_SECONDS` (slow handlers: smaller windows,
        spread over the threads)."""
        most = max(1, min(self.cfg.batch_size, self.cfg.prefetch // 2))
        per = self.c.seconds_per_message
        return most if per <= 0 else max(1, min(most, int(WINDOW_SECONDS / per)))

    def _windows_moving(self) -> bool:
        """A window is running whose handler is not slow (it will be done soon)."""
        now = self.c.clock()
        for window, lane in self.jobs.items():
            running = window.running
            if lane == "window" and (running is None or now - running[1] <= CUT_AFTER):
                return True
        return False

    def _start(self, lane: Lane, items: list[Held]) -> None:
        c = self.c
        window = Window(items, clock=c.clock)
        if lane == "window":
            job = functools.partial(
                run_window,
                c.engine,
                consumer=self.cfg.name,
                window=window,
                handler=c.handler,
                batch_handler=c.batch_handler,
            )
        else:
            job = functools.partial(
                run_single,
                c.engine,
                consumer=self.cfg.name,
                window=window,
                handler=c.handler,
                limit=self.cfg.delivery_limit,
                charge=lane == "suspect",
                broker_limit=self.cfg.broker_delivery_limit,
            )
        self.jobs[window] = lane
        future = self._loop.run_in_executor(c.pool, job)
        future.add_done_callback(functools.partial(self._done, window))

    def _done(self, window: Window, future: asyncio.Future[Outcome]) -> None:
        c, m = self.c, self.c.metrics
        if window in c.abandoned:  # its handler timed out: its deliveries were dealt with then
            c.abandoned.discard(window)
            m.abandoned_handlers = len(c.abandoned)
            return
        self.jobs.pop(window, None)
        if self.closed and not self.jobs and self in c._runs:
            c._runs.remove(self)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:  # a bug of the kit: the broker gives them again
            log.error(
                "the consumer kit failed on %d deliveries: requeued",
                len(window.items),
                exc_info=error,
            )
            for held in window.items:
                self._settle(held, requeue=True)
            self._after()
            return
        self._apply(window, future.result())

    def _apply(self, window: Window, out: Outcome) -> None:
        c, m = self.c, self.c.metrics
        now = c.clock()
        if out.handled or out.failed or out.dead or out.requeue:
            m.add("transactions")
        done = len(out.handled) + len(out.deduplicated)
        if done:
            took = now - window.created
            m.handler_seconds.observe_many(took, done)
            if out.handled and out.handler_seconds:  # a handler's time sizes the next windows
                per = out.handler_seconds / len(out.handled)
                c.seconds_per_message = (
                    per if c.seconds_per_message <= 0 else (0.8 * c.seconds_per_message + 0.2 * per)
                )
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
        if out.outage is not None:
            self._database_failed(out.outage)
        elif not out.abandoned:
            self._database_answered()
        self._after()

    def _after(self) -> None:
        self.c.metrics.in_flight = len(self.held)
        self._flush()
        self._schedule_pump()
        if not self.held:
            self._settled.set()

    def _database_failed(self, exc: BaseException) -> None:
        c, m = self.c, self.c.metrics
        m.add("database_errors")
        if c.outage.failed(exc, c.clock()):
            m.add("database_outages")
            m.database_down = True
            log.warning(
                "consumer %s: the database does not answer (%s): consumption paused, %d "
                "deliveries held and retried with backoff; none counts against its delivery "
                "limit",
                self.cfg.name,
                _first_line(exc),
                len(self.held),
            )
        self._loop.call_later(max(0.0, c.outage.next_try - c.clock()), self._schedule_pump)

    def _database_answered(self) -> None:
        c = self.c
        took = c.outage.recovered(c.clock())
        if took is not None:
            c.metrics.database_down = False
            c.metrics.add("reconnects")
            log.info(
                "consumer %s: the database answers again after %.1fs: consuming",
                self.cfg.name,
                took,
            )

    # ------------------------------------------------------------ settling

    def _finish(self, held: Held, counter: str) -> None:
        self.c.metrics.add(counter)
        if self.held.pop(held.tag, None) is not None:
            self.tracker.finished(held.tag)

    def _settle(self, held: Held, *, requeue: bool) -> None:
        if self.held.pop(held.tag, None) is None:
            return
        self.tracker.settled(held.tag)
        self.c.metrics.add("requeued" if requeue else "dead_lettered")
        if requeue:
            self._nack(held.tag)
        else:
            self._reject(held.tag)

    def _dead_letter(self, held: Held) -> None:
        log.error("consumer %s dead-letters %s: %s", self.cfg.name, held.message_id, held.failure)
        if held.broker_limited:
            self.c.metrics.add("broker_limited")
        if self.dead_letters is None:
            self._settle(held, requeue=False)
            return
        if self.held.pop(held.tag, None) is None:
            return
        self.c.metrics.add("dead_lettered")
        self._send(self._publish_dead_letter(held))

    async def _publish_dead_letter(self, held: Held) -> None:
        """Publish a copy with headers saying why (confirmed), then ack the delivery; on any
        failure reject it instead (the queue's own dead-letter exchange, if any, takes it)."""
        msg, cfg = held.message, self.cfg
        headers = {
            **msg.headers,
            "x-outbox-dead-letter-reason": (held.failure or "failed")[:ERROR_CHARS],
            "x-outbox-dead-letter-attempts": held.attempts,
            "x-outbox-dead-letter-consumer": cfg.name,
            "x-outbox-dead-letter-queue": cfg.queue,
            "x-outbox-original-exchange": msg.exchange,
            "x-outbox-original-routing-key": msg.routing_key,
        }
        try:
            assert self.dead_letters is not None and cfg.dead_letter_exchange is not None
            exchange = (
                self.dead_letters.default_exchange
                if cfg.dead_letter_exchange == ""
                else await self.dead_letters.get_exchange(cfg.dead_letter_exchange, ensure=False)
            )
            await exchange.publish(
                aio_pika.Message(
                    msg.body,
                    headers=headers,
                    message_id=msg.message_id,
                    content_type=msg.content_type,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=cfg.dead_letter_routing_key or msg.routing_key,
                mandatory=True,
            )
        except Exception as exc:
            log.error(
                "consumer %s could not publish the dead letter of %s (%s): rejected",
                cfg.name,
                msg.message_id,
                _first_line(exc),
            )
            self._reject(held.tag)
            return
        self.tracker.finished(held.tag)
        self._flush()

    def _send(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _nack(self, tag: int) -> None:
        self.tracker.settled(tag)
        self._frames.append(("nack", tag, False, 1))
        self._wake.set()

    def _reject(self, tag: int) -> None:
        self.tracker.settled(tag)
        self._frames.append(("reject", tag, False, 1))
        self._wake.set()

    def _flush(self) -> None:
        if self.closed or self.channel.is_closed:
            return  # the broker gives them again; the inbox absorbs them
        for ack in self.tracker.acks(multiple=self.cfg.ack_multiple):
            self._frames.append(("ack", ack.tag, ack.multiple, ack.count))
        if self._frames:
            self._wake.set()

    async def send_forever(self) -> None:
        """Send acks, nacks and rejects one task, in the order they were decided: a ``multiple``
        ack must never reach the broker before an ack or nack of a tag below it."""
        m = self.c.metrics
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._frames:
                kind, tag, multiple, count = self._frames.popleft()
                try:
                    if kind == "ack":
                        await self.underlay.basic_ack(tag, multiple=multiple)
                        m.add("ack_frames")
                        m.add("acked", count)
                    elif kind == "nack":
                        await self.underlay.basic_nack(tag, multiple=False, requeue=True)
                    else:
                        await self.underlay.basic_reject(tag, requeue=False)
                except Exception:  # a closed channel: the broker gives them again
                    self._frames.clear()
            self._sent.set()

    # ------------------------------------------------------------ time

    async def tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.ack_interval)
            self.tick()

    def tick(self) -> None:
        """Cut windows whose handler is slow, fail handlers past their timeout."""
        now = self.c.clock()
        limit = self.cfg.handler_timeout
        for window, lane in list(self.jobs.items()):
            running = window.running
            if running is None:
                continue
            held, started = running
            if limit is not None and now - started > limit and window.abandon():
                if lane == "window" and self.c.batch_handler is not None:
                    self._batch_timed_out(window, now - started)
                else:
                    self._timed_out(window, held, now - started)
                # a statement the hung handler waits on is cancelled (psycopg sends the cancel
                # request on a connection of its own: not on the event loop)
                self._loop.run_in_executor(None, window.cancel_statement)
            elif lane == "window" and now - started > CUT_AFTER:
                rest = window.cut()
                if rest:
                    self._again(rest)
                self._schedule_pump()  # the slow window no longer holds the next one back
        if self.c.outage.down:
            self._schedule_pump()
        self._flush()

    def _timed_out(self, window: Window, held: Held, took: float) -> None:
        c, m = self.c, self.c.metrics
        self.jobs.pop(window, None)
        c.abandoned.add(window)
        m.abandoned_handlers = len(c.abandoned)
        m.add("handler_timeouts")
        m.add("handler_failures")
        log.error(
            "consumer %s: the handler of %s ran past %.0fs: its attempt failed; the "
            "thread is left to return on its own",
            self.cfg.name,
            held.message_id,
            took,
        )
        # the hung thread keeps its slot: the next jobs get a pool of their own
        c.pool.shutdown(wait=False)
        c.pool = c._new_pool()
        held.failure = f"the handler ran past handler_timeout ({self.cfg.handler_timeout:g}s)"
        self._again([h for h in window.items if h is not held])
        if held.tag in self.held:
            self._route(held, front=True)
        self._after()

    def _batch_timed_out(self, window: Window, took: float) -> None:
        """A batch handler ran past the timeout: which message hangs is unknown, so none is
        charged; they run again one at a time, where the one that hangs fails alone."""
        c, m = self.c, self.c.metrics
        self.jobs.pop(window, None)
        c.abandoned.add(window)
        m.abandoned_handlers = len(c.abandoned)
        log.warning(
            "consumer %s: a batch handler ran past %.0fs over %d messages: they run "
            "again one at a time",
            self.cfg.name,
            took,
            len(window.items),
        )
        c.pool.shutdown(wait=False)
        c.pool = c._new_pool()
        for held in window.items:
            if held.tag in self.held:
                self.singles.append(held)
        self._after()

    # ------------------------------------------------------------ end

    async def drain(self, *, timeout: float) -> None:
        """Finish what is held (within ``timeout``), then ack it."""
        if self.held:
            self._settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), timeout)
        if self.held:
            log.warning(
                "%d deliveries not finished after %.0fs: not acked (the broker gives them again)",
                len(self.held),
                timeout,
            )
        if self._sends:
            await asyncio.wait(set(self._sends), timeout=5)
        self._flush()
        if self._frames:
            self._sent.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sent.wait(), 5)

    def close(self) -> None:
        self.closed = True
        self.fresh.clear()
        self.singles.clear()
        self.suspects.clear()


def _one_at_a_time(batch_handler: BatchHandler | None) -> Handler:
    """A batch handler as a handler of one message (for messages that run alone)."""
    assert batch_handler is not None

    def handle(message: Message, conn: Connection) -> None:
        batch_handler([message], conn)

    return handle


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _delivery_count(headers: Mapping[str, Any], *, redelivered: bool) -> int:
    """A quorum queue's ``x-delivery-count`` header (absent on a first delivery and on classic
    queues): how often the broker had this message back before. Trusted only on a delivery the
    broker flags ``redelivered``: on a first one the header can only be the producer's (a
    quorum queue adds it from the second delivery on, overwriting any), and a producer's
    ``x-delivery-count: 999`` once dead-lettered a message before its handler ever ran."""
    if not redelivered:
        return 0
    value = headers.get("x-delivery-count")
    return value if isinstance(value, int) and value > 0 else 0
