"""The consumer kit: manual acks, a per-consumer prefetch, an inbox, a failure policy.

::

    broker ──deliveries (≤ prefetch unacked)──▶ Consumer ──threads──▶ handle_once
           ◀── ack multiple over finished runs ──┘        (inbox row + handler, one transaction)
           ◀── nack/requeue, or reject (dead-letter) at the delivery limit

- ``basic.qos(prefetch)`` on the consumer's own channel: RabbitMQ's per-consumer limit, so at most
  ``prefetch`` deliveries are in the kit's hands (in handlers or awaiting their ack).
- Handlers run ``concurrency`` at a time in threads, each in its own database transaction with the
  inbox row (:func:`~app.consumer.inbox.handle_once`). A delivery is acknowledged only after its
  transaction committed; acks go out every ``ack_interval``, or at once when half the prefetch
  window is held, as one ``basic.ack(multiple)`` over the longest finished run
  (:class:`~app.consumer.acks.AckTracker`).
- A handler that raises: the delivery is requeued until it failed ``delivery_limit`` times (the
  broker's ``x-delivery-count`` on quorum queues, else the kit's own count), then rejected without
  requeue so the broker dead-letters it (a queue with ``x-dead-letter-exchange``) or drops it. It
  never loops forever, and the other deliveries go on meanwhile.
- The broker cancels the consumer (queue deleted), or the channel or connection is lost: the kit
  logs it, reconnects with backoff; unacked deliveries come again and the inbox absorbs the ones
  whose effect was done.
- Graceful stop: cancel the consumer, let running handlers finish within ``stop_timeout``, ack
  what finished, close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from app.consumer.acks import AckTracker
from app.consumer.inbox import Handler, Message, handle_once
from app.db import make_engine
from app.logs import redact_url
from app.publisher.metrics import Histogram

log = logging.getLogger("app.consumer")


def pool_size(engine: Engine) -> int | None:
    """How many connections ``engine`` keeps open between uses (None: a pool without that bound)."""
    size = getattr(engine.pool, "size", None)
    return int(size()) if callable(size) else None


def consumer_engine(url: str, *, concurrency: int, **kwargs: Any) -> Engine:
    """An engine for a consumer with ``concurrency`` handler threads: one kept connection per
    thread. With fewer, each thread beyond the pool opens a new database session per message
    and closes it after (measured at prefetch 10 and 8 threads on the default pool of 5: about
    300 sessions for 2,000 messages, four times the PostgreSQL CPU per message)."""
    kwargs.setdefault("pool_size", max(5, concurrency))
    return make_engine(url, **kwargs)


COUNTERS = {
    "deliveries": "Deliveries received (redeliveries included).",
    "redelivered": "Deliveries the broker flagged as redelivered.",
    "handled": "Messages whose handler ran and committed (effect done).",
    "deduplicated": "Deliveries already in the inbox: acked without running the handler.",
    "acked": "Deliveries acknowledged.",
    "ack_frames": "basic.ack frames sent (each may settle many deliveries).",
    "requeued": "Failed deliveries requeued (below the delivery limit).",
    "dead_lettered": "Deliveries rejected without requeue (delivery limit, no message_id).",
    "cancels": "Consumers cancelled by the broker (queue deleted).",
    "reconnects": "Connections or channels lost and opened again.",
}
LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    name: str  # the inbox key: consumers of the same name share effects
    queue: str
    prefetch: int = 100
    concurrency: int = 8
    delivery_limit: int = 5
    ack_interval: float = 0.05
    #: one basic.ack(multiple) per finished run (default), or one ack per delivery
    ack_multiple: bool = True
    stop_timeout: float = 10.0
    reconnect_max_delay: float = 10.0

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be at least 1" for name, value in
            (("prefetch", self.prefetch), ("concurrency", self.concurrency),
             ("delivery_limit", self.delivery_limit)) if value < 1
        ]  # fmt: skip
        if not self.name.strip() or not self.queue.strip():
            problems.append("name and queue must not be empty")
        if problems:
            raise ValueError("invalid consumer config: " + "; ".join(problems))


@dataclass
class ConsumerMetrics:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    handler_seconds: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS))
    in_flight: int = 0
    prefetch: int = 0
    connected: bool = False

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n


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
        ):
            gauge = GaugeMetricFamily(f"outbox_consumer_{name}", doc, labels=["consumer"])
            gauge.add_metric(self.label, value)
            yield gauge
        hist = HistogramMetricFamily(
            "outbox_consumer_handler_seconds",
            "Handler and inbox transaction time.",
            labels=["consumer"],
        )
        hist.add_metric(self.label, self.m.handler_seconds.cumulative(),
                        sum_value=self.m.handler_seconds.sum)  # fmt: skip
        yield hist


def registry_for(metrics: ConsumerMetrics, *, consumer: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConsumerCollector(metrics, consumer=consumer))
    return registry


class _Lost(Exception):
    """The consumer must start over on a new connection (cancelled, channel or connection lost)."""


class Consumer:
    """Consumes one queue into ``handler`` with an inbox; :meth:`run` until ``stop`` is set."""

    def __init__(self, *, config: ConsumerConfig, amqp_url: str, engine: Engine,
                 handler: Handler, metrics: ConsumerMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.config = config
        self.amqp_url = amqp_url
        self.engine = engine
        self.handler = handler
        self.metrics = metrics or ConsumerMetrics()
        self.metrics.prefetch = config.prefetch
        self.clock = clock
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="outbox-consumer")
        kept = pool_size(engine)
        if kept is not None and kept < config.concurrency:
            log.warning(
                "consumer %s: the database engine keeps %d connections for %d handler threads: "
                "the others open and close a connection per message (a new database session "
                "each, several times the CPU per message); make the engine with pool_size >= "
                "%d (consumer_engine)", config.name, kept, config.concurrency,
                config.concurrency,
            )  # fmt: skip
        self._failures: dict[str, int] = {}  # message_id -> failed attempts (classic queues)
        self._rng = random.Random()

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
                    log.warning("consumer %s on %s: %s; consuming again in %.1fs",
                                self.config.name, self.config.queue, exc or type(exc).__name__,
                                wait)  # fmt: skip
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
                    delay = min(self.config.reconnect_max_delay, delay * 2)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            c = self.metrics.counts
            log.info("consumer %s stopped: %d handled, %d deduplicated, %d dead-lettered, "
                     "%d requeued", self.config.name, c["handled"], c["deduplicated"],
                     c["dead_lettered"], c["requeued"])  # fmt: skip

    # ------------------------------------------------------------ one connection

    async def _session(self, stop: asyncio.Event) -> None:
        cfg = self.config
        conn = await aio_pika.connect(  # named: operators (and tests) find it in the broker
            self.amqp_url, timeout=10,
            client_properties={"connection_name": f"outbox-consumer {cfg.name}"},
        )  # fmt: skip
        async with conn:
            channel = await conn.channel()
            await channel.set_qos(prefetch_count=cfg.prefetch)
            queue = await channel.get_queue(cfg.queue, ensure=True)
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

            (await channel.get_underlay_channel()).on_consumer_cancel_callbacks.add(on_cancel)
            channel.close_callbacks.add(on_close)
            run = _Run(self, channel)
            tag = await queue.consume(run.on_message, no_ack=False)
            self.metrics.connected = True
            log.info(
                "consumer %s consuming %s from %s (prefetch %d, %d handlers)", cfg.name,
                cfg.queue, redact_url(self.amqp_url), cfg.prefetch, cfg.concurrency,
            )  # fmt: skip
            flusher = asyncio.create_task(run.flush_forever())
            stopping = asyncio.create_task(stop.wait())
            broken = asyncio.create_task(lost.wait())
            try:
                await asyncio.wait([stopping, broken], return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set() and not lost.is_set():
                    with contextlib.suppress(Exception):
                        await queue.cancel(tag)
                await run.drain(timeout=cfg.stop_timeout)
            finally:
                for task in (flusher, stopping, broken):
                    task.cancel()
                self.metrics.connected = False
            if lost.is_set() and not stop.is_set():
                raise _Lost("; ".join(why) or "consumer lost")


class _Run:
    """The deliveries of one channel: handlers, failure policy, batched acks."""

    def __init__(self, consumer: Consumer, channel: AbstractChannel) -> None:
        self.c = consumer
        self.channel = channel
        self.tracker = AckTracker()
        self.held: dict[int, AbstractIncomingMessage] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        tag = message.delivery_tag
        assert tag is not None
        m = self.c.metrics
        m.add("deliveries")
        m.add("redelivered", int(bool(message.redelivered)))
        self.tracker.received(tag)
        self.held[tag] = message
        m.in_flight = len(self.held)
        task = asyncio.create_task(self._guarded(message, tag))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, message: AbstractIncomingMessage, tag: int) -> None:
        """A delivery is always settled: a bug in the kit requeues it rather than leave it
        unacked forever (which would hold the prefetch window, and every ack after it)."""
        try:
            await self._handle(message, tag)
        except Exception:
            log.exception("the consumer kit failed on delivery %d: requeued", tag)
            await self._settle(message, tag, requeue=True)

    async def _handle(self, message: AbstractIncomingMessage, tag: int) -> None:
        c, m = self.c, self.c.metrics
        mid = message.message_id
        if not mid:
            log.error("delivery %d on %s has no message_id: cannot deduplicate, rejected",
                      tag, c.config.queue)  # fmt: skip
            await self._settle(message, tag, requeue=False)
            return
        headers = dict(message.headers or {})
        counted = headers.get("x-delivery-count")
        failures = int(counted) if isinstance(counted, int) else c._failures.get(mid, 0)
        msg = Message(message_id=mid, body=message.body, routing_key=message.routing_key or "",
                      exchange=message.exchange or "", headers=headers,
                      content_type=message.content_type, redelivered=bool(message.redelivered),
                      delivery_count=failures)  # fmt: skip
        started = time.perf_counter()
        try:
            done = await asyncio.get_running_loop().run_in_executor(
                c._pool, lambda: handle_once(c.engine, consumer=c.config.name, message=msg,
                                             handler=c.handler))  # fmt: skip
        except Exception as exc:
            m.handler_seconds.observe(time.perf_counter() - started)
            c._failures[mid] = failures + 1
            final = failures + 1 >= c.config.delivery_limit
            level = logging.ERROR if final else logging.WARNING
            log.log(level, "handler failed on %s (attempt %d of %d): %s%s", mid, failures + 1,
                    c.config.delivery_limit, exc,
                    ": dead-lettered" if final else ": requeued")  # fmt: skip
            await self._settle(message, tag, requeue=not final)
            if final:
                c._failures.pop(mid, None)
            return
        m.handler_seconds.observe(time.perf_counter() - started)
        c._failures.pop(mid, None)
        m.add("handled" if done else "deduplicated")
        self.tracker.finished(tag)
        if len(self.held) >= max(1, c.config.prefetch // 2):
            # the window is half full: ack now rather than at the next tick, or the broker
            # (which sends no more than ``prefetch`` unacked) waits on us
            await self.flush()

    async def _settle(self, message: AbstractIncomingMessage, tag: int, *, requeue: bool) -> None:
        with contextlib.suppress(Exception):  # a closed channel: the broker redelivers anyway
            if requeue:
                await message.nack(requeue=True)
            else:
                await message.reject(requeue=False)
        self.c.metrics.add("requeued" if requeue else "dead_lettered")
        self.tracker.settled(tag)
        self.held.pop(tag, None)
        self.c.metrics.in_flight = len(self.held)

    async def flush(self) -> None:
        got = self.tracker.ackable()
        if got is None:
            return
        upto, count = got
        done = [self.held.pop(t) for t in sorted(t for t in self.held if t <= upto)]
        self.c.metrics.in_flight = len(self.held)
        if not done or self.channel.is_closed:
            return  # the broker redelivers; the inbox absorbs
        with contextlib.suppress(Exception):
            if self.c.config.ack_multiple:
                await done[-1].ack(multiple=True)
                self.c.metrics.add("ack_frames")
            else:
                for message in done:
                    await message.ack()
                    self.c.metrics.add("ack_frames")
            self.c.metrics.add("acked", count)

    async def flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.c.config.ack_interval)
            await self.flush()

    async def drain(self, *, timeout: float) -> None:
        """Let running handlers finish (within ``timeout``), then ack what finished."""
        if self.tasks:
            _, late = await asyncio.wait(set(self.tasks), timeout=timeout)
            if late:
                log.warning("%d handlers still running after %.0fs: their deliveries are not "
                            "acked (the broker redelivers them)", len(late), timeout)  # fmt: skip
        await self.flush()
