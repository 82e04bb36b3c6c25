"""The consumer kit: manual acks, a per-consumer prefetch, an inbox, a failure policy.

This module is the I/O shell: the broker's connection and channel, the handler threads, the
frames sent. What the kit decides (which job runs which delivery, which tags to ack, nack or
reject, when to give a message up, when the database is out) is :mod:`app.consumer.core`, fed
events here and answering with commands; what a job does with the database is
:mod:`app.consumer.work`.

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
  older one still runs (:class:`~app.consumer.acks.AckTracker`, in the core): a slow handler
  holds only its own delivery (and those that ran before it in its window). A window whose
  handler is slow is cut: the deliveries it had not started go to another window.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic as spec_basic
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Engine

from app.consumer.config import COUNTERS, ConsumerMetrics
from app.consumer.config import ConsumerConfig as ConsumerConfig
from app.consumer.core import Abandoned, DeadLetter, Frame, KitCore, KitState, Start
from app.consumer.core import Outage as Outage
from app.consumer.held import ERROR_CHARS, Held, Message, Outcome, Window
from app.consumer.inbox import BatchHandler, Handler
from app.consumer.work import Jobs
from app.db import make_engine
from app.logs import first_line, redact_url

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
        #: what the kit's decisions keep across channels (:mod:`app.consumer.core`)
        self.state = KitState(
            config=config,
            metrics=self.metrics,
            outage=self.outage,
            batch_handler=batch_handler is not None,
            clock=clock,
        )
        self.jobs = Jobs(
            engine=engine, config=config, handler=self.handler, batch_handler=batch_handler
        )
        self.pool = self._new_pool()
        self._runs: list[_Run] = []
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
        return [*self.state.abandoned, *(w for run in self._runs for w in run.core.jobs)]

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
            underlay = await channel.get_underlay_channel()
            run = _Run(self, underlay, dead_letters)
            watch = _Watch(self, run)
            underlay.on_consumer_cancel_callbacks.add(watch.cancelled)
            channel.close_callbacks.add(watch.closed)
            self._runs.append(run)
            try:
                # aiormq's delivery as it is: aio-pika's IncomingMessage adds an object and a
                # task per delivery on the event loop, which is the kit's bottleneck (the
                # consume figures in docs/consumer.md)
                tag = (await underlay.basic_consume(queue.name, run.on_delivery)).consumer_tag or ""
                await self._consume(run, stop, watch, tag)
            finally:
                if not run.core.jobs:  # else its jobs still report, and it goes when they are done
                    self._runs.remove(run)
            if watch.lost.is_set() and not stop.is_set():
                raise _Lost("; ".join(watch.why) or "consumer lost")

    async def _consume(self, run: _Run, stop: asyncio.Event, watch: _Watch, tag: str) -> None:
        """Until ``stop`` or the channel is lost; on ``stop``, cancel and drain what is held."""
        cfg = self.config
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
        broken = asyncio.create_task(watch.lost.wait())
        try:
            await asyncio.wait([stopping, broken], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() and not watch.lost.is_set():
                with contextlib.suppress(Exception):
                    await run.underlay.basic_cancel(tag)
                await run.drain(timeout=cfg.stop_timeout)
        finally:
            run.core.close()
            for task in (ticker, sender, stopping, broken):
                task.cancel()
            self.metrics.connected = False


class _Watch:
    """Why a session ends: the broker cancelled the consumer, or the channel closed."""

    def __init__(self, consumer: Consumer, run: _Run) -> None:
        self.consumer, self.run = consumer, run
        self.lost = asyncio.Event()
        self.why: list[str] = []

    def cancelled(self, frame: Any) -> None:
        self.consumer.metrics.add("cancels")
        tag = getattr(frame, "consumer_tag", None)
        queue = self.consumer.config.queue
        self.why.append(f"the broker cancelled consumer {tag} (queue {queue} deleted?)")
        self.lost.set()

    def closed(self, *args: Any) -> None:
        self.run.core.channel_closed()  # its tags mean nothing now: no more acks on it
        self.why.append(f"channel closed: {args[-1] if args else 'unknown'}")
        self.lost.set()


class _Run:
    """One channel's I/O around its :class:`~app.consumer.core.KitCore`: deliveries and job
    outcomes in, the core's commands out (jobs on the handler threads, frames to the broker in
    the order decided, dead letters published)."""

    def __init__(self, consumer: Consumer, underlay: Any, dead_letters: Any) -> None:
        self.c = consumer
        self.cfg = consumer.config
        self.core = KitCore(consumer.state)
        self.underlay = underlay
        self.dead_letters: AbstractChannel | None = dead_letters
        self._pump_scheduled = False
        self._sends: set[asyncio.Task[None]] = set()
        self._frames: deque[Frame] = deque()
        self._wake = asyncio.Event()
        self._sent = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._settled = asyncio.Event()

    async def on_delivery(self, delivered: DeliveredMessage) -> None:
        deliver = delivered.delivery
        assert isinstance(deliver, spec_basic.Deliver) and deliver.delivery_tag is not None
        props = delivered.header.properties
        redelivered = bool(deliver.redelivered)
        message = Message(
            message_id=props.message_id or "",
            body=delivered.body,
            routing_key=deliver.routing_key or "",
            exchange=deliver.exchange or "",
            headers=dict(props.headers or {}),
            content_type=props.content_type,
            redelivered=redelivered,
        )
        self.core.delivered(deliver.delivery_tag, message, redelivered=redelivered)
        self._carry_out()

    def _carry_out(self, *, pump: bool = True) -> None:
        """Do what the core decided, in order."""
        for command in self.core.take():
            if isinstance(command, Frame):
                self._frames.append(command)
                self._wake.set()
            elif isinstance(command, Start):
                job = functools.partial(self.c.jobs.run, command.lane, command.window)
                future = self._loop.run_in_executor(self.c.pool, job)
                future.add_done_callback(functools.partial(self._done, command.window))
            elif isinstance(command, DeadLetter):
                self._send(self._publish_dead_letter(command.held))
            elif isinstance(command, Abandoned):
                # the hung thread keeps its slot: the next jobs get a pool of their own; a
                # statement it waits on is cancelled (psycopg sends the cancel request on a
                # connection of its own: not on the event loop)
                self.c.pool.shutdown(wait=False)
                self.c.pool = self.c._new_pool()
                self._loop.run_in_executor(None, command.window.cancel_statement)
            else:
                delay = max(0.0, command.when - self.c.clock())
                self._loop.call_later(delay, self._schedule_pump)
        if not self.core.held:
            self._settled.set()
        if pump:
            self._schedule_pump()

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and not self.core.closed:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        self.core.pump()
        self._carry_out(pump=False)

    def _done(self, window: Window, future: asyncio.Future[Outcome]) -> None:
        if future.cancelled():
            self.core.job_done(window, None)
        elif (error := future.exception()) is not None:
            self.core.job_failed(window, error)
        else:
            self.core.job_done(window, future.result())
        if self.core.closed and not self.core.jobs and self in self.c._runs:
            self.c._runs.remove(self)
        self._carry_out()

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
                first_line(exc),
            )
            self.core.dead_letter_failed(held)
        else:
            self.core.dead_letter_sent(held)
        self._carry_out(pump=False)

    def _send(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def send_forever(self) -> None:
        """Send acks, nacks and rejects one task, in the order they were decided: a ``multiple``
        ack must never reach the broker before an ack or nack of a tag below it."""
        m = self.c.metrics
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._frames:
                frame = self._frames.popleft()
                try:
                    if frame.kind == "ack":
                        await self.underlay.basic_ack(frame.tag, multiple=frame.multiple)
                        m.add("ack_frames")
                        m.add("acked", frame.count)
                    elif frame.kind == "nack":
                        await self.underlay.basic_nack(frame.tag, multiple=False, requeue=True)
                    else:
                        await self.underlay.basic_reject(frame.tag, requeue=False)
                except Exception:  # a closed channel: the broker gives them again
                    self._frames.clear()
            self._sent.set()

    async def tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.ack_interval)
            self.core.tick()
            self._carry_out()

    async def drain(self, *, timeout: float) -> None:
        """Finish what is held (within ``timeout``), then ack it."""
        if self.core.held:
            self._settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), timeout)
        if self.core.held:
            log.warning(
                "%d deliveries not finished after %.0fs: not acked (the broker gives them again)",
                len(self.core.held),
                timeout,
            )
        if self._sends:
            await asyncio.wait(set(self._sends), timeout=5)
        self.core.flush()
        self._carry_out(pump=False)
        if self._frames:
            self._sent.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sent.wait(), 5)


def _one_at_a_time(batch_handler: BatchHandler | None) -> Handler:
    """A batch handler as a handler of one message (for messages that run alone)."""
    assert batch_handler is not None

    def handle(message: Message, conn: Connection) -> None:
        batch_handler([message], conn)

    return handle
