"""The stream relay: drains rows for RabbitMQ streams, exactly once, beside the exchange path.

One :class:`LaneWorker` per lane this publisher holds. A worker connects to the stream's leader
(the stream protocol, rstream's client), declares a producer under the lane's reference name,
asks the broker the last publishing id it stored for it, and hands that to
:meth:`~app.streams.store.StreamStore.resume`: rows at or below it are confirmed without a
publish, rows above it that already have an id go out again under it, in order. Only then does
it claim new rows. It does this after every (re)connect and every takeover, so a row's message
is in the stream once, whatever died when (docs/guarantees.md, "Streams").

Outcomes: a publish confirm settles its rows ``confirmed``; a publish error ends them
``failed`` with the broker's reason, or (the stream unavailable, the producer unknown) puts them
back to ``pending`` without their ids; a stream that does not exist or is refused pauses its
lane with backoff, and after ``destination_retry_budget`` attempts its rows without an id end
``failed``. A connection that closes, or that answers nothing for ``confirm_timeout`` with
publishes outstanding, is dropped and made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rstream import exceptions as rs_errors
from rstream import schema
from rstream.client import Client

from app.outbox.content import Limits
from app.outbox.records import Backoff
from app.settings import Settings
from app.streams.endpoint import StreamEndpoint, stream_url_of
from app.streams.envelope import StreamEnvelopeError, to_stream_message
from app.streams.store import Lane, LaneLost, StreamRow, StreamStore

log = logging.getLogger(__name__)
T = TypeVar("T")

PUBLISHER_ID = 1
#: A request to the broker (declare, query) that takes longer means the connection is dead.
REQUEST_TIMEOUT = 10.0
#: Bytes of a Publish frame besides its messages (size, key, version, publisher id, count).
FRAME_OVERHEAD = 4 + 2 + 2 + 1 + 4
#: Bytes per message besides its data: publishing id and data length.
MESSAGE_OVERHEAD = 8 + 4
#: RabbitMQ's publish errors (3.10) all say the producer cannot store now: its stream has no
#: leader, was deleted or is refused, the producer went with its connection or its leader. It
#: then refuses every later publish of the producer too. So any publish error ends the session,
#: and the next one asks the broker which ids it has: the rows keep their ids (a copy stored by
#: a publisher that lost the lane is then settled, never appended again). A row is never ended
#: ``failed`` on a publish error; a stream that does not exist fails its rows past the retry
#: budget at the declare (docs/streams.md).
#: The declare's answers that mean the destination is missing or refused, not the connection.
DESTINATION_ERRORS = (
    rs_errors.StreamDoesNotExist,
    rs_errors.AccessRefused,
    rs_errors.StreamNotAvailable,
)
_CODES = {cls.code: cls.__name__ for cls in rs_errors.ServerError._registry.values()}


@dataclasses.dataclass(slots=True)
class StreamStats:
    """Cumulative counts of the relay (the publisher's metrics and report read them)."""

    published: int = 0
    confirmed: int = 0
    #: rows the broker already had when a lane resumed: confirmed without a publish
    settled_by_sequence: int = 0
    #: rows published again under their ids after a resume (the broker drops them if it has them)
    resent: int = 0
    failed: int = 0
    takeovers: int = 0
    reconnects: int = 0
    lanes_held: int = 0
    outstanding: int = 0


class DestinationDown(RuntimeError):
    """The stream is missing, refused or without a leader: the lane waits (rows untouched).
    ``gone``: missing or refused, its rows end failed past the retry budget; else an outage
    (no leader), its rows wait for it whatever it lasts."""

    def __init__(self, reason: str, *, gone: bool) -> None:
        super().__init__(reason)
        self.gone = gone


class ConnectionDead(RuntimeError):
    pass


async def _in_thread(fn: Callable[..., T], /, **kwargs: Any) -> T:
    return await asyncio.to_thread(fn, **kwargs)


class LaneWorker:
    def __init__(self, relay: StreamRelay, lane: Lane) -> None:
        self.relay = relay
        self.lane = lane
        self.settings = relay.settings
        self.store = relay.store
        self.owner = relay.owner
        self.client: Client | None = None
        #: publishing id -> (row id, monotonic send time)
        self.pending: dict[int, tuple[int, float]] = {}
        #: rows confirmed by the broker, not yet written (the writer task's)
        self._confirmed: list[int] = []
        self._write_due = asyncio.Event()
        self._writing = 0
        self._writer_task: asyncio.Task[None] | None = None
        self._errors: list[tuple[int, int]] = []
        self._wake = asyncio.Event()
        self.stopping = False
        self.lost = False
        self.task: asyncio.Task[None] | None = None
        self.failures = 0  # consecutive failed connects or declares
        self.released = False
        self.down_reason = ""

    @property
    def name(self) -> str:
        return f"stream {self.lane.stream!r} lane {self.lane.lane}"

    # ------------------------------------------------------------ broker

    async def _locator(self) -> tuple[Client, tuple[str, int]]:
        """A connection to the first node of the URL that answers, starting after the one that
        answered last: a node that is down costs one refused connect per session."""
        addresses = self.relay.endpoint.addresses
        last: BaseException | None = None
        for n in range(len(addresses)):
            address = addresses[(self.relay.next_node + n) % len(addresses)]
            try:
                client = await self._client(*address)
            except (OSError, TimeoutError, rs_errors.ServerError) as exc:
                last = exc
                continue
            self.relay.next_node = (self.relay.next_node + n) % len(addresses)
            return client, address
        assert last is not None
        raise last

    async def _connect(self) -> Client:
        locator, given = await self._locator()
        props = dict(locator.server_properties or {})  # closing the client clears them
        try:
            try:
                leader, _ = await asyncio.wait_for(
                    locator.query_leader_and_replicas(self.lane.stream), REQUEST_TIMEOUT
                )
            except DESTINATION_ERRORS as exc:
                raise _down(exc, self.lane.stream) from exc
        finally:
            await _close(locator)
        advertised = (props.get("advertised_host"), str(props.get("advertised_port")))
        if (leader.host, str(leader.port)) == advertised:
            # the node we were given leads the stream: the address we were given (a proxy or a
            # load balancer in front of it may differ from what the node advertises)
            client = await self._client(*given)
        else:
            client = await self._client(leader.host, leader.port)
        try:
            client.add_handler(schema.PublishConfirm, self._on_confirm, name="outbox")
            client.add_handler(schema.PublishError, self._on_error, name="outbox")
            try:
                await asyncio.wait_for(
                    client.declare_publisher(
                        stream=self.lane.stream,
                        reference=self.lane.reference,
                        publisher_id=PUBLISHER_ID,
                    ),
                    REQUEST_TIMEOUT,
                )
            except DESTINATION_ERRORS as exc:
                raise _down(exc, self.lane.stream) from exc
        except BaseException:
            await _close(client)
            raise
        return client

    async def _client(self, host: str, port: int) -> Client:
        ep = self.relay.endpoint
        client = Client(
            host=host,
            port=port,
            frame_max=1024 * 1024,
            heartbeat=max(1, self.settings.heartbeat or 60),
            connection_name=f"outbox {self.owner} {self.lane.stream}#{self.lane.lane}",
            connection_closed_handler=self._on_closed,
        )
        try:
            await asyncio.wait_for(client.start(), REQUEST_TIMEOUT)
            await asyncio.wait_for(
                client.authenticate(vhost=ep.vhost, username=ep.username, password=ep.password),
                REQUEST_TIMEOUT,
            )
        except BaseException:
            await _close(client)
            raise
        return client

    def _on_confirm(self, frame: schema.PublishConfirm) -> None:
        if frame.publisher_id != PUBLISHER_ID:
            return
        for seq in frame.publishing_ids:
            entry = self.pending.pop(seq, None)
            if entry is not None:
                self._confirmed.append(entry[0])
        self._write_due.set()
        self._wake.set()

    async def _writer(self) -> None:
        """Writes the confirmed rows, all that came while the previous write ran in one
        transaction (a write per confirm frame cost PostgreSQL more than the claims)."""
        while True:
            await self._write_due.wait()
            self._write_due.clear()
            while self._confirmed:
                ids, self._confirmed = self._confirmed, []
                self._writing = len(ids)
                n = await _in_thread(
                    self.store.confirmed,
                    owner=self.owner,
                    lane=self.lane,
                    ids=ids,
                    published_at=dt.datetime.now(dt.UTC),
                )
                self._writing = 0
                self.relay.stats.confirmed += n

    async def _flush(self, timeout: float = 10.0) -> None:
        """Let the writer write what came, then stop it."""
        task, self._writer_task = self._writer_task, None
        if task is None:
            return
        deadline = time.monotonic() + timeout
        while (self._confirmed or self._writing) and not task.done():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    def _on_error(self, frame: schema.PublishError) -> None:
        if frame.publisher_id == PUBLISHER_ID:
            self._errors.extend((e.publishing_id, e.response_code) for e in frame.errors)
            self._wake.set()

    def _on_closed(self, info: Any) -> None:
        self._wake.set()

    def _alive(self, client: Client) -> bool:
        if not client.is_connection_alive():
            return False
        # rstream only logs missing heartbeats; a peer silent for two intervals is gone
        # (``_last_heartbeat`` is the time any frame last arrived)
        silent = time.monotonic() - getattr(client, "_last_heartbeat", time.monotonic())
        return silent <= 2 * max(1, self.settings.heartbeat or 60) + 1

    # ------------------------------------------------------------ loop

    async def run(self) -> None:
        backoff = Backoff(self.settings.backoff_base, self.settings.reconnect_max_delay)
        while not self.stopping and not self.relay.stopped.is_set():
            try:
                ended = await self._session()
                if ended == "idle":
                    await _in_thread(self.store.release, owner=self.owner, lanes=[self.lane])
                    self.released = True
                if ended in ("idle", "stopped"):
                    return
            except LaneLost as exc:
                log.warning("%s: lost the lane (%s); its rows are the new owner's", self.name, exc)
                self.lost = True
                return
            except DestinationDown as exc:
                self.failures += 1
                self.down_reason = str(exc)
                await self._destination_down(str(exc), gone=exc.gone)
                await self._sleep(
                    Backoff(self.settings.backoff_base, self.settings.backoff_max).delay(
                        self.failures
                    )
                )
                continue
            except (
                TimeoutError,
                OSError,
                ConnectionError,
                ConnectionDead,
                rs_errors.ServerError,
            ) as exc:
                self.failures += 1
                self.relay.stats.reconnects += 1
                log.warning(
                    "%s: the stream connection ended (%s: %s) with %d publishes unconfirmed; "
                    "reconnecting, the broker's last stored id settles them",
                    self.name,
                    type(exc).__name__,
                    exc,
                    len(self.pending),
                )
            except Exception as exc:  # the database failed a call: the lane starts over
                self.failures += 1
                log.warning(
                    "%s: %s: %s; starting over, the broker's last stored id settles what is "
                    "outstanding",
                    self.name,
                    type(exc).__name__,
                    str(exc).splitlines()[0][:300],
                )
            finally:
                await self._drop()
            await self._sleep(backoff.delay(min(self.failures, 10)))

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.relay.stopped.wait(), seconds)

    async def _drop(self) -> None:
        await self._flush()
        self.pending.clear()
        self._confirmed.clear()
        self._errors.clear()
        self.relay.stats.outstanding = sum(len(w.pending) for w in self.relay.workers.values())
        if self.client is not None:
            client, self.client = self.client, None
            await _close(client)

    async def _destination_down(self, reason: str, *, gone: bool) -> None:
        budget = self.settings.destination_retry_budget
        if not gone:  # an outage: the rows wait for the leader, budgets untouched
            if self.failures == 1 or self.failures % 20 == 0:
                log.warning("%s: %s; its rows wait (attempt %d)", self.name, reason, self.failures)
            return
        if self.failures == 1:
            log.warning(
                "%s: %s; its rows wait (retry %d of %d)", self.name, reason, self.failures, budget
            )
        if self.failures >= budget:
            failed = await _in_thread(
                self.store.fail_pending, owner=self.owner, lane=self.lane, reason=reason
            )
            if failed:
                self.relay.stats.failed += failed
                log.error(
                    "%s: %s after %d attempts: %d rows end failed",
                    self.name,
                    reason,
                    self.failures,
                    failed,
                )

    async def _session(self) -> str:
        self.client = client = await self._connect()
        self._writer_task = asyncio.create_task(self._writer(), name=f"{self.name} writes")
        stored = await asyncio.wait_for(
            client.query_publisher_sequence(stream=self.lane.stream, reference=self.lane.reference),
            REQUEST_TIMEOUT,
        )
        resumed = await _in_thread(
            self.store.resume,
            owner=self.owner,
            lane=self.lane,
            stored=stored,
            limit=1_000_000,
            lease_seconds=self.settings.lease_seconds,
        )
        stats = self.relay.stats
        stats.settled_by_sequence += resumed.settled
        stats.resent += len(resumed.again)
        if self.failures and self.down_reason:
            log.info("%s: the stream is back (after %d attempts)", self.name, self.failures)
        self.failures = 0
        self.down_reason = ""
        log.info(
            "%s: producer %s at id %d%s: %d rows the broker already had settled, %d sent again "
            "under their ids",
            self.name,
            self.lane.reference,
            stored,
            " (taken over)" if self.lane.taken_over else "",
            resumed.settled,
            len(resumed.again),
        )
        self.lane = dataclasses.replace(self.lane, taken_over=False)
        await self._publish(client, resumed.again)
        idle_since = time.monotonic()
        while not self.stopping:
            await self._settle()
            if not self._alive(client):
                raise ConnectionDead("the connection closed")
            self._check_timeout()
            room = self.settings.window - len(self.pending)
            rows: list[StreamRow] = []
            if room > 0 and not self.relay.stopped.is_set():
                rows = await _in_thread(
                    self.store.claim,
                    owner=self.owner,
                    lane=self.lane,
                    limit=min(room, self.settings.claim_batch),
                    lease_seconds=self.settings.lease_seconds,
                )
            if rows:
                idle_since = time.monotonic()
                await self._publish(client, rows)
                continue
            if self.relay.stopped.is_set() and not self.pending:
                return "stopped"
            if not self.pending and time.monotonic() - idle_since > self.relay.idle_release:
                return "idle"  # the lane is given up: the relay takes it again when rows come
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval)
        return "stopped"

    def _check_timeout(self) -> None:
        if not self.pending:
            return
        oldest = min(sent for _, sent in self.pending.values())
        if time.monotonic() - oldest > self.settings.confirm_timeout:
            raise ConnectionDead(f"no confirm for {self.settings.confirm_timeout:.0f} s")

    async def _publish(self, client: Client, rows: list[StreamRow]) -> None:
        frame_max = client.frame_max
        failed: dict[str, list[int]] = {}
        batch: list[schema.Message] = []
        size = FRAME_OVERHEAD
        now = time.monotonic()
        for row in rows:
            try:
                data = to_stream_message(row, limits=self.relay.limits)
                if FRAME_OVERHEAD + MESSAGE_OVERHEAD + len(data) > frame_max:
                    raise StreamEnvelopeError(
                        f"the message is {len(data)} bytes, more than the stream connection's "
                        f"frame size of {frame_max} bytes"
                    )
            except StreamEnvelopeError as exc:
                failed.setdefault(str(exc), []).append(row.id)
                continue
            if size + MESSAGE_OVERHEAD + len(data) > frame_max:
                await client.send_frame(schema.Publish(publisher_id=PUBLISHER_ID, messages=batch))
                batch, size = [], FRAME_OVERHEAD
            batch.append(schema.Message(publishing_id=row.seq, filter_value=None, data=data))
            size += MESSAGE_OVERHEAD + len(data)
            self.pending[row.seq] = (row.id, now)
        if batch:
            await client.send_frame(schema.Publish(publisher_id=PUBLISHER_ID, messages=batch))
        self.relay.stats.published += len(rows) - sum(len(v) for v in failed.values())
        self.relay.stats.outstanding = sum(len(w.pending) for w in self.relay.workers.values())
        for reason, ids in failed.items():
            n = await _in_thread(
                self.store.failed, owner=self.owner, lane=self.lane, ids=ids, reason=reason
            )
            self.relay.stats.failed += n
            log.warning(
                "%s: %d rows cannot be stream messages and end failed: %s", self.name, n, reason
            )

    async def _settle(self) -> None:
        """Publish errors end the session at once; a failed confirm write ends it too."""
        errors, self._errors = self._errors, []
        if errors:
            self._errored(errors)
        task = self._writer_task
        if task is not None and task.done():
            self._writer_task = None
            exc = task.exception()
            if exc is not None:
                raise exc
        self.relay.stats.outstanding = sum(len(w.pending) for w in self.relay.workers.values())

    def _errored(self, errors: list[tuple[int, int]]) -> None:
        codes = sorted({code for _, code in errors})
        names = ", ".join(f"{_CODES.get(c, 'code')} ({c})" for c in codes)
        raise ConnectionDead(f"the stream refused {len(errors)} publishes: {names}")

    async def finish(self, timeout: float) -> None:
        """The relay stopped (no more claims): wait up to ``timeout`` for the confirms
        outstanding to be written, then end. What is left unconfirmed stays ``in_flight`` with
        its id: the next holder of the lane asks the broker about it."""
        self._wake.set()
        if self.task is None:
            return
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        self.stopping = True
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


def _down(exc: BaseException, stream: str) -> DestinationDown:
    gone = not isinstance(exc, rs_errors.StreamNotAvailable)
    return DestinationDown(_reason(exc, stream), gone=gone)


def _reason(exc: BaseException, stream: str) -> str:
    if isinstance(exc, rs_errors.StreamDoesNotExist):
        return f"stream {stream!r} does not exist"
    if isinstance(exc, rs_errors.AccessRefused):
        return f"access to stream {stream!r} refused"
    if isinstance(exc, rs_errors.StreamNotAvailable):
        return f"stream {stream!r} has no leader available"
    return f"stream {stream!r}: {type(exc).__name__} {exc}"


async def _close(client: Client) -> None:
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(client.close(), 5)


class StreamRelay:
    """Takes the lanes of streams with open rows and runs a :class:`LaneWorker` for each."""

    def __init__(self, *, settings: Settings, store: StreamStore, owner: str) -> None:
        self.settings = settings
        self.store = store
        self.owner = f"{owner}#stream"
        self.endpoint = StreamEndpoint.parse(stream_url_of(settings))
        self.next_node = 0  # the URL's node a lane asks first (the last that answered)
        self.stats = StreamStats()
        self.workers: dict[tuple[str, int], LaneWorker] = {}
        self.stopped = asyncio.Event()
        self.idle_release = 30.0
        self._known: set[str] = set()
        self.limits = Limits(
            max_body_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: look for streams with open rows every poll interval (at least every
        second), take their free lanes, renew the ones held."""
        try:
            while not stop.is_set():
                try:
                    await self._round()
                except Exception:  # the database is down: the next round tries again
                    log.exception("stream relay: a round failed; trying again")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(self.settings.poll_interval, 1.0))
        finally:
            await self.close()

    async def _round(self) -> None:
        streams = await _in_thread(self.store.open_streams)
        for stream in streams:
            if stream not in self._known:
                await _in_thread(
                    self.store.ensure_lanes, stream=stream, lanes=self.settings.stream_lanes
                )
                self._known.add(stream)
        for key, worker in list(self.workers.items()):
            if worker.task is not None and worker.task.done():
                del self.workers[key]
        wanted = set(streams) | {s for s, _ in self.workers}
        lanes = await _in_thread(
            self.store.acquire,
            owner=self.owner,
            streams=sorted(wanted),
            lease_seconds=self.settings.lease_seconds,
        )
        held = {lane.key for lane in lanes}
        for key, worker in list(self.workers.items()):
            if key not in held and not worker.lost:  # another took it: stop, writing nothing
                worker.stopping = True
                worker.lost = True
                log.warning(
                    "%s: lost the lane (its lease ran out: another publisher holds it); "
                    "%d publishes unconfirmed are the new holder's to settle",
                    worker.name,
                    len(worker.pending),
                )
        for lane in lanes:
            if lane.key in self.workers or lane.stream not in streams:
                continue
            if lane.taken_over:
                self.stats.takeovers += 1
                log.warning(
                    "%s lane %d: taken over from a publisher whose lease expired",
                    lane.stream,
                    lane.lane,
                )
            worker = LaneWorker(self, lane)
            worker.task = asyncio.create_task(
                worker.run(), name=f"stream-lane {lane.stream}#{lane.lane}"
            )
            self.workers[lane.key] = worker
        self.stats.lanes_held = len(self.workers)

    async def close(self) -> None:
        self.stopped.set()
        st = self.stats
        if st.published or st.settled_by_sequence or st.failed:
            log.info(
                "stream relay %s stopping: published %d, confirmed %d, settled by the broker's "
                "ids %d, sent again %d, failed %d, lanes taken over %d, sessions restarted %d",
                self.owner,
                st.published,
                st.confirmed,
                st.settled_by_sequence,
                st.resent,
                st.failed,
                st.takeovers,
                st.reconnects,
            )
        workers = list(self.workers.values())
        await asyncio.gather(*(w.finish(self.settings.shutdown_timeout) for w in workers))
        mine = [w.lane for w in workers if not w.lost and not w.released]
        self.workers.clear()
        if mine:
            with contextlib.suppress(Exception):
                await _in_thread(self.store.release, owner=self.owner, lanes=mine)
