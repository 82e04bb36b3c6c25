"""Reading a RabbitMQ stream with the inbox: each message's effect happens once, in stream order.

``StreamConsumer(config=ConsumerConfig(name=..., queue=STREAM), stream_url=..., engine=...,
handler=...)``; ``await consumer.run(stop)``. ``outbox consume --stream STREAM --handler
module:function`` runs one from the command line. The handler, the inbox and the attempts are
the AMQP kit's (:mod:`app.consumer.work`): the same windows in one transaction, the same
:class:`~app.consumer.inbox.Message`, the same ``outbox_inbox`` and ``outbox_consumer_attempts``.

What differs, because a stream is a log and not a queue:

- **Where it starts.** The broker keeps the consumer's position: the offset stored under the
  consumer's name (``subscriber_name`` = ``config.name``, ``store_offset``/``query_offset``).
  The first run reads from the stream's first offset; a later one from the stored offset + 1.
- **When the position moves.** Messages are decided in offset order, one window (up to
  ``batch_size`` messages, one transaction) at a time. The offset of the last decided message is
  stored after its commit, at most every ``offset_interval`` seconds, and when the consumer
  stops. A crash re-reads what was decided since the last store: the inbox skips those (their
  effect committed with their inbox row), so nothing happens twice.
- **A handler that fails.** A stream cannot nack: the consumer does not move past the message.
  The failure is counted (``outbox_consumer_attempts``, as the kit does), the window's other
  messages run alone in order, and the message is tried again after a pause (``RETRY_DELAY``,
  doubling up to ``RETRY_MAX_DELAY``) with its attempt counted before its handler runs. At the
  delivery limit it is **given up**: logged at ERROR with the reason, kept in
  ``outbox_consumer_attempts`` (attempts = the limit, ``last_error`` = why), and skipped; read
  again later, it is found past its limit and skipped without running. A handler past
  ``handler_timeout`` is a failed attempt (its thread is abandoned, its transaction cannot commit).
- **A message that kills the process** (no exception reaches us): after a start, messages run
  alone, each charged before its handler runs (the kit's treatment of a redelivery), until
  ``batch_size`` new ones have their effect: the one that killed the last run is among them, so
  a message that kills every run is given up after the limit like one that raises.
- **The database failing** is not the message's failure: the same messages are tried again with
  backoff and jitter and nothing is counted against them (the kit's rule).
- **The broker connection lost**: the consumer reconnects and goes on from the next undecided
  offset it knows; the stream is not re-read.

One stream per consumer, one window at a time (``concurrency`` is not used: order is the
stream's). With ``mode="message"`` every message runs alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine

from app.consumer import inbox
from app.consumer.config import ConsumerConfig, ConsumerMetrics
from app.consumer.core import Outage
from app.consumer.held import Held, Message, Outcome, Window
from app.consumer.inbox import BatchHandler, Handler
from app.consumer.work import Jobs

log = logging.getLogger("app.consumer")

#: the first pause before a failed message is tried again; it doubles up to RETRY_MAX_DELAY
RETRY_DELAY = 0.2
RETRY_MAX_DELAY = 5.0
#: how often the consumer looks at a running handler's age and at the connection
TICK = 0.1
#: chunks the broker may send ahead of what the consumer took (the protocol's credit)
CREDIT = 10


@dataclass(frozen=True, slots=True)
class Read:
    """A message read from the stream: where, and what the handler will see."""

    offset: int
    message: Message | None  # None: it has no message_id (it cannot be deduplicated)


def to_message(decoded: Any, *, stream: str) -> Message | None:
    """An AMQP 1.0 message as rstream decodes it -> what a handler sees: ``message_id`` from
    its properties, the application properties as headers (text keys, bytes values as text),
    ``routing_key`` the stream's name and ``exchange`` "" (as for a queue's default exchange).
    None without a message id."""
    props = getattr(decoded, "properties", None)
    mid = _text(getattr(props, "message_id", None))
    if not mid:
        return None
    headers = {_text(k): _text(v) for k, v in (decoded.application_properties or {}).items()}
    body = decoded.body
    return Message(
        message_id=str(mid),
        body=bytes(body) if body is not None else b"",
        routing_key=stream,
        exchange="",
        headers=headers,
        content_type=_text(getattr(props, "content_type", None)),
    )


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else value


class _Lost(Exception):
    """The stream connection is gone: connect again from the next undecided offset."""


class _Stopping(Exception):
    """Stop was asked while a message waited to be tried again: it stays undecided."""


class StreamConsumer:
    """Reads ``config.queue`` (a stream) into ``handler`` with the inbox; :meth:`run` until
    ``stop`` is set."""

    def __init__(
        self,
        *,
        config: ConsumerConfig,
        stream_url: str,
        engine: Engine,
        handler: Handler | None = None,
        batch_handler: BatchHandler | None = None,
        metrics: ConsumerMetrics | None = None,
        offset_interval: float = 1.0,
    ) -> None:
        if (handler is None) == (batch_handler is None):
            raise ValueError("give the consumer a handler or a batch_handler (one of them)")
        self.config = config
        self.stream = config.queue
        self.stream_url = stream_url
        self.jobs = Jobs(
            engine=engine,
            config=config,
            handler=handler or _one_at_a_time(batch_handler),
            batch_handler=batch_handler,
        )
        self.metrics = metrics or ConsumerMetrics()
        self.offset_interval = offset_interval
        self.outage = Outage(
            name=config.name, max_delay=config.database_retry_max_delay, rng=random.Random()
        )
        #: the next offset to decide (None until the broker said where to start)
        self.next_offset: int | None = None
        #: the last offset stored on the broker by this process
        self.stored: int | None = None
        self._stored_at = 0.0
        #: new effects still to run alone and charged after a start (see the module's doc)
        self.suspect_left = config.batch_size
        self._stop = asyncio.Event()

    def ready(self) -> tuple[bool, dict[str, object]]:
        details: dict[str, object] = {
            "consumer": self.config.name,
            "stream": self.stream,
            "connected": self.metrics.connected,
            "database_down": self.outage.down,
            "next_offset": self.next_offset,
        }
        return self.metrics.connected and not self.outage.down, details

    async def run(self, stop: asyncio.Event) -> None:
        """Read, handle and store positions until ``stop``; reconnect with backoff."""
        self._stop = stop
        delay = RETRY_DELAY
        while not stop.is_set():
            try:
                await self._session()
                delay = RETRY_DELAY
            except _Stopping:
                break
            except (_Lost, OSError, ConnectionError, TimeoutError) as exc:
                self._lost(exc, delay)
            except Exception as exc:  # rstream's server errors: a stream missing, refused
                if type(exc).__module__.split(".")[0] != "rstream":
                    raise
                self._lost(exc, delay)
            self.metrics.connected = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(RETRY_MAX_DELAY * 2, delay * 2)

    def _lost(self, exc: BaseException, delay: float) -> None:
        self.metrics.add("reconnects")
        log.warning(
            "stream consumer %s on %s: %s; connecting again in %.1fs",
            self.config.name,
            self.stream,
            f"{type(exc).__name__}: {exc}".rstrip(": "),
            delay,
        )

    # ---------------------------------------------------------------- the connection

    async def _session(self) -> None:
        from rstream.amqp import amqp_decoder
        from rstream.constants import ConsumerOffsetSpecification, OffsetType
        from rstream.consumer import Consumer, MessageContext

        from app.streams.endpoint import StreamEndpoint

        ep = StreamEndpoint.parse(self.stream_url)
        lost = asyncio.Event()
        reads: asyncio.Queue[Read] = asyncio.Queue(maxsize=max(2 * self.config.batch_size, 100))
        client = Consumer(
            host=ep.host,
            port=ep.port,
            vhost=ep.vhost,
            username=ep.username,
            password=ep.password,
            connection_name=f"outbox-consume-{self.config.name}",
            on_close_handler=lambda _info: lost.set(),
        )

        async def on_message(decoded: Any, context: MessageContext) -> None:
            await reads.put(Read(context.offset, to_message(decoded, stream=self.stream)))

        try:
            await client.start()
            start = await self._start_offset(client)
            spec = (
                ConsumerOffsetSpecification(OffsetType.FIRST)
                if start is None
                else ConsumerOffsetSpecification(OffsetType.OFFSET, start)
            )
            await client.subscribe(
                self.stream,
                on_message,
                decoder=amqp_decoder,
                offset_specification=spec,
                subscriber_name=self.config.name,
                initial_credit=CREDIT,
            )
            self.metrics.connected = True
            log.info(
                "stream consumer %s reads %s from %s",
                self.config.name,
                self.stream,
                "its first offset" if start is None else f"offset {start}",
            )
            await self._consume(client, reads, lost)
        finally:
            self.metrics.connected = False
            with contextlib.suppress(Exception):  # a position not stored is read again
                await self._store(client, force=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5)

    async def _start_offset(self, client: Any) -> int | None:
        """Where to read from: the next undecided offset this process knows, else the offset
        stored under the consumer's name + 1, else None (the stream's first offset)."""
        from rstream.exceptions import OffsetNotFound

        if self.next_offset is not None:
            return self.next_offset
        try:
            stored = await client.query_offset(self.stream, self.config.name)
        except OffsetNotFound:
            return None
        self.stored = stored
        return int(stored) + 1

    async def _consume(self, client: Any, reads: asyncio.Queue[Read], lost: asyncio.Event) -> None:
        """Windows of what was read, in order, each decided before the next; positions stored."""
        while not self._stop.is_set():
            if lost.is_set():
                raise _Lost("the stream connection closed")
            batch = await self._next_batch(reads)
            if batch:
                await self._decide(batch)
            await self._store(client)

    async def _next_batch(self, reads: asyncio.Queue[Read]) -> list[Read]:
        """Up to ``batch_size`` messages read: waits ``TICK`` at most for the first, takes
        only what is there for the rest. Skips what was decided already (read before a
        reconnect)."""
        try:
            first = await asyncio.wait_for(reads.get(), TICK)
        except TimeoutError:
            return []
        batch = [first]
        while len(batch) < self.config.batch_size and not reads.empty():
            batch.append(reads.get_nowait())
        floor = self.next_offset
        return [r for r in batch if floor is None or r.offset >= floor]

    async def _store(self, client: Any, *, force: bool = False) -> None:
        """Store the last decided offset under the consumer's name: after its commit, at most
        every ``offset_interval`` seconds (and at a stop)."""
        if self.next_offset is None or (
            self.stored is not None and self.next_offset - 1 <= self.stored
        ):
            return
        now = time.monotonic()
        if not force and now - self._stored_at < self.offset_interval:
            return
        offset = self.next_offset - 1
        await client.store_offset(self.stream, self.config.name, offset)
        self.stored, self._stored_at = offset, now

    # ---------------------------------------------------------------- deciding messages

    async def _decide(self, batch: list[Read]) -> None:
        """Every message of ``batch`` decided (handled, found done, or given up), in order."""
        self.metrics.add("deliveries", len(batch))
        alone = self.config.mode == "message" or self.suspect_left > 0
        pending: list[tuple[Read, Held]] = []
        for read in batch:
            if read.message is None:
                self._give_up_unkeyed(read)
                continue
            pending.append((read, Held(tag=read.offset, message=read.message)))
        if not alone and pending:
            pending = await self._window(pending)
        for read, held in pending:
            await self._alone(held, charge=self.suspect_left > 0)
            self._decided(read.offset)
        if batch:
            self._decided(batch[-1].offset)

    def _decided(self, offset: int) -> None:
        if self.next_offset is None or offset + 1 > self.next_offset:
            self.next_offset = offset + 1

    async def _window(self, pending: list[tuple[Read, Held]]) -> list[tuple[Read, Held]]:
        """The messages in one transaction. Returns those still undecided, in order: all of
        them when a handler failed (they then run alone: the window was rolled back)."""
        while True:
            out = await self._job("window", [h for _, h in pending])
            if out.outage is not None:
                await self._outage(out.outage)
                continue
            self._database_answered()
            self.metrics.add("transactions")
            self._count(out)
            done = {id(h) for h in out.handled + out.deduplicated}
            rest = [(r, h) for r, h in pending if id(h) not in done]
            if out.failed or out.isolate or out.abandoned:
                return rest
            if not rest:
                return []
            pending = rest  # duplicates were taken out: the others again, together

    async def _alone(self, held: Held, *, charge: bool) -> None:
        """One message until it is decided: its effect, found done, or given up after the
        delivery limit. Failed attempts are tried again after a growing pause."""
        delay = RETRY_DELAY
        while True:
            out = await self._job("suspect" if charge else "single", [held])
            if out.outage is not None:
                await self._outage(out.outage)
                continue
            self._database_answered()
            self.metrics.add("transactions")
            self._count(out)
            if out.handled or out.deduplicated:
                if out.handled and self.suspect_left > 0:
                    self.suspect_left -= 1
                return
            if out.dead:
                await self._give_up(held)
                return
            if out.requeue:
                self.metrics.add("requeued")
                log.warning(
                    "stream consumer %s: %s at offset %d failed (attempt %d of %d), again in %.1fs",
                    self.config.name,
                    held.message_id,
                    held.tag,
                    held.attempts,
                    self.config.delivery_limit,
                    delay,
                )
                await self._pause(delay)
                delay = min(RETRY_MAX_DELAY, delay * 2)
            charge = True  # from now on counted before its handler runs, as a redelivery

    def _count(self, out: Outcome) -> None:
        m = self.metrics
        m.add("handled", len(out.handled))
        m.add("deduplicated", len(out.deduplicated))
        m.add("handler_failures", len(out.requeue) + len(out.dead))
        if out.handled:
            n = len(out.handled)
            m.handler_seconds.observe_many(out.handler_seconds / n, n)

    async def _job(self, lane: str, items: Sequence[Held]) -> Outcome:
        """A job of :mod:`app.consumer.work` on a thread; a handler running past
        ``handler_timeout`` is abandoned (its transaction cannot commit) and charged."""
        window = Window(list(items))
        task = asyncio.ensure_future(asyncio.to_thread(self.jobs.run, lane, window))
        limit = self.config.handler_timeout
        while True:
            done, _ = await asyncio.wait({task}, timeout=TICK)
            if task in done:
                try:
                    return task.result()
                except Exception as exc:  # the job's own code failed: as an outage, retried
                    log.exception("stream consumer %s: a job failed", self.config.name)
                    return Outcome(outage=exc)
            running = window.running
            if limit is None or running is None or time.monotonic() - running[1] <= limit:
                continue
            if window.abandon():
                return self._timed_out(window, running[0], limit)

    def _timed_out(self, window: Window, held: Held, limit: float) -> Outcome:
        self.metrics.add("handler_timeouts")
        self.metrics.abandoned_handlers += 1
        log.error(
            "stream consumer %s: the handler of %s ran past %gs: abandoned",
            self.config.name,
            held.message_id,
            limit,
        )
        asyncio.get_running_loop().run_in_executor(None, window.cancel_statement)
        held.failure = f"handler timed out after {limit:g}s"
        return Outcome(abandoned=True, failed=[held])

    async def _give_up(self, held: Held) -> None:
        """The delivery limit reached: logged, kept in ``outbox_consumer_attempts``, skipped."""
        reason = held.failure or "delivery limit reached"
        log.error(
            "stream consumer %s gives up %s at offset %d of %s: %s",
            self.config.name,
            held.message_id,
            held.tag,
            self.stream,
            reason,
        )
        self.metrics.add("dead_lettered")
        attempts = max(held.attempts, self.config.delivery_limit)

        def record() -> None:
            with self.jobs.engine.begin() as conn:
                _keep(conn, self.config.name, held.message_id, attempts, reason)

        while True:
            try:
                await asyncio.to_thread(record)
            except Exception as exc:  # the database: not the message's
                await self._outage(exc)
                continue
            self._database_answered()
            return

    def _give_up_unkeyed(self, read: Read) -> None:
        self.metrics.add("dead_lettered")
        log.error(
            "stream consumer %s skips offset %d of %s: no message_id, it cannot be deduplicated",
            self.config.name,
            read.offset,
            self.stream,
        )

    async def _outage(self, exc: BaseException) -> None:
        """The database failed: wait (backoff with jitter), count nothing against messages."""
        self.metrics.add("database_errors")
        now = time.monotonic()
        if self.outage.failed(exc, now):
            self.metrics.add("database_outages")
            self.metrics.database_down = True
            log.warning(
                "stream consumer %s: the database does not answer (%s): waiting",
                self.config.name,
                f"{type(exc).__name__}: {exc}".splitlines()[0],
            )
        await self._pause(max(0.0, self.outage.next_try - now))

    def _database_answered(self) -> None:
        took = self.outage.recovered(time.monotonic())
        if took is not None:
            self.metrics.database_down = False
            log.info(
                "stream consumer %s: the database answers again after %.1fs", self.config.name, took
            )

    async def _pause(self, seconds: float) -> None:
        """Sleep, unless stop is asked: then the message in hand stays undecided."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        if self._stop.is_set():
            raise _Stopping


def _keep(conn: Connection, consumer: str, message_id: str, attempts: int, reason: str) -> None:
    inbox.give_up(conn, consumer=consumer, message_id=message_id, attempts=attempts, error=reason)


def _one_at_a_time(batch_handler: BatchHandler | None) -> Handler:
    assert batch_handler is not None

    def handler(message: Message, conn: Connection) -> None:
        batch_handler([message], conn)

    return handler
