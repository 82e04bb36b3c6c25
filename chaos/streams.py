"""The fault matrix for stream destinations (scenarios 21): rows naming a RabbitMQ stream,
appended exactly once by the publisher's stream relay (app/streams/relay.py), through publisher
crashes, a broker crash and a cluster leader's death.

What differs from the exchange scenarios is the record and the bound. A stream keeps what it
stored, so the verifier is no consumer running beside the drain: :class:`StreamVerifier` reads
the whole stream from its first offset once the publishers have stopped, and counts each message
id (``properties.message_id``, the row's) over distinct offsets. There are no possible
duplicates: the broker drops a publish whose publishing id it already stored for the lane's
producer, so the allowed duplicates are 0 and every expected id must be there exactly once.

The batch is written through the application's API (:func:`app.outbox.enqueue.enqueue`,
``Message(stream=...)``), due over the scenario's flow; 21a-long adds the steady producer of
:mod:`chaos.producer` writing rows for the same stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rstream.amqp import amqp_decoder
from rstream.client import Client
from rstream.constants import ConsumerOffsetSpecification, OffsetType
from rstream.consumer import Consumer
from sqlalchemy import Engine, select, text

from app.outbox.enqueue import Message, enqueue
from app.outbox.schema import outbox
from app.streams.endpoint import StreamEndpoint
from app.topology import stream_arguments
from chaos import outbox as ob
from chaos import procs
from chaos.amqp import Topology
from chaos.producer import SteadyProducer
from chaos.runner import Ctx, Scenario, ScenarioError, Step
from chaos.services import Cluster, PrivateServices
from chaos.verifier import Received

#: seconds: a killed publisher's lanes are taken over once their lease expires
LEASE = 3
#: lanes per stream: two producer references, so a takeover resumes more than one sequence
LANES = 2
#: services.sh puts the stream listener on the AMQP port - 120; cluster.sh on the AMQP base
#: port - 1000, node N at + N - 1 (deploy/local)
SERVICES_STREAM_OFFSET = -120
CLUSTER_STREAM_OFFSET = -1000
#: a read of the whole stream ends this long after its last message once every expected id is in
QUIET = 2.0
READ_TIMEOUT = 90.0


def _env(**values: object) -> dict[str, str]:
    return {f"OUTBOX_{k.upper()}": str(v) for k, v in values.items()}


STREAM_ENV = _env(stream_lanes=LANES, lease_seconds=LEASE)
CLUSTER_STREAM_ENV = {**STREAM_ENV, **_env(heartbeat=2, confirm_timeout=5)}


# ---------------------------------------------------------------- addresses


def _url(port: int) -> str:
    return f"rabbitmq-stream://guest:guest@127.0.0.1:{port}/"


def services_stream_url(services: PrivateServices) -> str:
    return _url(services.amqp_port + SERVICES_STREAM_OFFSET)


def node_stream_port(cluster: Cluster, node: int) -> int:
    return cluster.port(node) + CLUSTER_STREAM_OFFSET


def node_stream_url(cluster: Cluster, node: int) -> str:
    return _url(node_stream_port(cluster, node))


def node_of_stream_port(cluster: Cluster, port: int) -> int:
    return cluster.node_of_port(port - CLUSTER_STREAM_OFFSET)


async def _client(url: str) -> Client:
    ep = StreamEndpoint.parse(url)
    client = Client(host=ep.host, port=ep.port, frame_max=1024 * 1024, heartbeat=60)
    try:
        await asyncio.wait_for(client.start(), 10)
        await asyncio.wait_for(
            client.authenticate(vhost=ep.vhost, username=ep.username, password=ep.password), 10
        )
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 5)
        raise
    return client


async def leader_of(url: str, stream: str) -> tuple[int, list[int]] | None:
    """The stream ports of the node leading ``stream`` and of its replicas (rstream's
    ``query_leader_and_replicas`` through the node at ``url``); None while no leader is elected
    or the node does not answer."""
    try:
        client = await _client(url)
    except Exception:
        return None
    try:
        leader, replicas = await asyncio.wait_for(client.query_leader_and_replicas(stream), 10)
        return int(leader.port), [int(r.port) for r in replicas]
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 5)


async def leader_node(ctx: Ctx, *, via: int, timeout: float, not_: int | None = None) -> int | None:
    """The node leading the scenario's stream, asked through node ``via``, once one (other than
    ``not_``) is elected; None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = await leader_of(node_stream_url(ctx.cluster, via), ctx.names["stream"])
        if found is not None:
            node = node_of_stream_port(ctx.cluster, found[0])
            ctx.data["replicas"] = sorted(node_of_stream_port(ctx.cluster, p) for p in found[1])
            if node != not_:
                return node
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------- the verifier


async def read_whole(
    url: str, stream: str, *, expected: set[str], timeout: float, quiet: float = QUIET
) -> dict[int, str]:
    """Every message of ``stream`` from its first offset: offset -> message id. Ends ``quiet``
    seconds after the last message once every ``expected`` id came (a copy after them shows),
    or at ``timeout`` (what came so far). Keyed by offset, so a chunk the client is sent twice
    is not a second copy; two offsets with one id are."""
    ep = StreamEndpoint.parse(url)
    consumer = Consumer(
        host=ep.host,
        port=ep.port,
        vhost=ep.vhost,
        username=ep.username,
        password=ep.password,
        connection_name="chaos stream verifier",
    )
    by_offset: dict[int, str] = {}
    last = time.monotonic()

    async def on_message(message: Any, context: Any) -> None:
        nonlocal last
        props = getattr(message, "properties", None)
        mid = getattr(props, "message_id", None)
        by_offset[int(context.offset)] = mid.decode() if isinstance(mid, bytes) else str(mid)
        last = time.monotonic()

    try:
        await asyncio.wait_for(consumer.start(), 10)
        await asyncio.wait_for(
            consumer.subscribe(
                stream=stream,
                callback=on_message,
                decoder=amqp_decoder,
                offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST),
            ),
            10,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            if time.monotonic() - last >= quiet and expected <= set(by_offset.values()):
                break
    finally:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(consumer.close(), 5)
    return by_offset


@dataclass
class StreamVerifier:
    """Reads ``stream`` whole, through the first of ``urls`` that answers (a cluster's node may
    be dead), once the publishers have stopped; :meth:`results` counts the copies of each id."""

    urls: Sequence[str]
    stream: str
    expected: set[str] = field(default_factory=set)
    by_offset: dict[int, str] | None = None
    read_from: str = ""
    read_errors: list[str] = field(default_factory=list)

    async def start(self) -> None:
        """Nothing to consume meanwhile: the stream is the record."""

    async def stop(self) -> None:
        """Nothing to stop."""

    async def settle(self, expected: set[str], *, timeout: float) -> bool:
        """Called with the confirmed rows' ids before the publishers stop: they are what the
        final read must find (the read itself waits for them, see :meth:`results`)."""
        self.expected = set(expected)
        return True

    async def read(self, *, timeout: float = READ_TIMEOUT) -> dict[int, str]:
        deadline = time.monotonic() + timeout
        while True:
            for url in self.urls:
                left = deadline - time.monotonic()
                try:
                    got = await read_whole(url, self.stream, expected=self.expected, timeout=left)
                except Exception as exc:  # the node is down, no leader yet: the next one
                    self.read_errors.append(f"{url}: {type(exc).__name__} {exc}"[:200])
                    continue
                if self.expected <= set(got.values()) or time.monotonic() >= deadline:
                    self.by_offset, self.read_from = got, url
                    return got
            if time.monotonic() >= deadline:
                raise ScenarioError(f"stream {self.stream} could not be read: {self.read_errors}")
            await asyncio.sleep(1.0)

    def results(self) -> Received:
        """The copies of each message id in the whole stream (read once, then kept)."""
        if self.by_offset is None:
            asyncio.run(self.read())
        assert self.by_offset is not None
        copies = collections.Counter(self.by_offset.values())
        return Received(
            copies=dict(copies), deliveries=len(self.by_offset), records=len(self.by_offset)
        )


def stream_verifier(ctx: Ctx, topology: Topology) -> StreamVerifier:
    """The verifier hook of the runner: the read goes through the nodes the scenario prefers
    (``ctx.data["read_urls"]``, set up front), else the private broker's stream port."""
    urls = ctx.data.get("read_urls") or [services_stream_url(ctx.services)]
    verifier = StreamVerifier(urls=urls, stream=ctx.names["stream"])
    ctx.data["stream_verifier"] = verifier
    return verifier


# ---------------------------------------------------------------- topology, rows, settings


def stream_topology(ctx: Ctx) -> Topology:
    """The scenario's stream (a queue of type stream, declared with the product's arguments,
    ``outbox declare --stream``'s), left to :class:`StreamVerifier` (no AMQP consumer)."""
    name = ctx.names["stream"] = f"chaos.{ctx.run}"
    size = 3 if ctx.scenario.cluster else None
    args = stream_arguments(max_length_bytes=2_000_000_000, initial_cluster_size=size)
    return Topology(queues={name: args}, unverified=(name,))


def stream_plan(ctx: Ctx, *, start: float) -> list[Message]:
    flow, n = ctx.scenario.flow, max(1, ctx.rows)
    return [
        Message(
            stream=ctx.names["stream"],
            body=ob.body_for(i),
            message_id=f"{ctx.run}-{i:06d}",
            not_before=dt.datetime.fromtimestamp(start + flow * i / n, tz=dt.UTC),
        )
        for i in range(ctx.rows)
    ]


def _write(engine: Engine, messages: list[Message], *, source: str) -> None:
    for at in range(0, len(messages), 2000):
        with engine.begin() as conn:
            enqueue(conn, messages[at : at + 2000], source=source)


async def write_batch(ctx: Ctx) -> None:
    """The batch through ``enqueue`` (rows with ``stream``), row i due at start + flow * i / n."""
    messages = stream_plan(ctx, start=time.time() + 0.5)
    ctx.expect = {m.message_id: ob.CONFIRMED for m in messages}
    await asyncio.to_thread(_write, ctx.engine, messages, source=f"{ctx.run}:1")


async def write_batch_and_produce(ctx: Ctx) -> None:
    """The batch, and a steady producer writing rows for the same stream until the kills end."""
    await write_batch(ctx)
    producer = SteadyProducer(db_url=ctx.db_url, stream=ctx.names["stream"], prefix=ctx.run)
    ctx.data["producer"] = producer.start()


async def on_private_broker(ctx: Ctx) -> None:
    """Setup: the publishers' stream URL is the private broker's; no duplicate is allowed."""
    ctx.publisher_env["OUTBOX_STREAM_URL"] = services_stream_url(ctx.services)
    ctx.result.allowed = 0


# ---------------------------------------------------------------- 21a: publisher kill -9


def kill_while_publishing(
    engine: Engine, proc: procs.Proc, *, timeout: float, locked: bool
) -> set[str]:
    """``kill -9`` of ``proc`` the first moment rows are in flight (claimed; sent or not; their
    confirm not written back); the rows in flight at the kill (empty: none came within
    ``timeout``, or none was left at the kill).

    ``locked``: read under a SHARE lock on the outbox held through the kill, so no write-back or
    claim commits between the read and the kill (the kill lands, as a rule, on publishes the
    broker stored whose confirms wait for the lock). Else killed right after a read saw rows in
    flight, and the rows in flight read after the kill (nobody else holds them until their
    lease expires): the kill lands wherever the publisher was, publishes unsent or unconfirmed
    included."""
    stmt = select(outbox.c.message_id).where(outbox.c.status == "in_flight")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.connect() as conn, conn.begin():
            if locked:
                conn.execute(text("LOCK TABLE outbox IN SHARE MODE"))
            held = {m for (m,) in conn.execute(stmt)}
            if held and locked:
                proc.kill9()
                return held
        if held:
            proc.kill9()
            with engine.connect() as conn:
                return {m for (m,) in conn.execute(stmt)}
        time.sleep(0.005)
    return set()


def kill_publishers(kills: int) -> Step:
    """21a: ``kills`` times, let the running publisher take the lanes over and publish, wait a
    random 0-1 s, kill it with ``kill -9`` at the next moment publishes are outstanding (every
    other kill under the outbox lock, see :func:`kill_while_publishing`), start another. A kill
    that found nothing in flight does not count: another follows (at most 3 more)."""

    async def inject(ctx: Ctx) -> None:
        rng = random.Random()
        held_at: list[int] = []
        for turn in range(kills + 3):
            if sum(1 for n in held_at if n) >= kills:
                break
            proc = ctx.publishers[-1]
            step = max(50, ctx.rows // 200)
            target = (await ctx.counts()).get("confirmed", 0) + step
            try:  # the new publisher took a lane over and published under it
                await ctx.wait_counts(
                    lambda c, t=target: c.get("confirmed", 0) >= t,
                    timeout=30,
                    what=f"{step} more rows confirmed by {proc.name}",
                )
            except ScenarioError as exc:
                ctx.note(f"kill {turn + 1}: {exc}")
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            if turn == 0:
                await ctx.fault_now(f"kill -9 of the publisher, {kills} times, publishes out")
            ctx.killed.append(proc)
            locked = turn % 2 == 0
            held = await asyncio.to_thread(
                kill_while_publishing, ctx.engine, proc, timeout=15, locked=locked
            )
            code = proc.popen.returncode if proc.popen else None
            ctx.check(f"publisher {proc.name} died of SIGKILL", code == -9)
            if turn == 0:
                await ctx.landed()
            counts = await ctx.counts()
            held_at.append(len(held))
            ctx.note(
                f"kill {turn + 1} ({'under the lock' if locked else 'unlocked'}): "
                f"{len(held)} rows in flight at the kill, "
                f"{counts.get('confirmed', 0)} confirmed after it"
            )
            await ctx.spawn_publisher()
        ctx.data.update(held_at=held_at, kills=kills)
        await stop_producing(ctx)

    return inject


async def stop_producing(ctx: Ctx) -> None:
    producer: SteadyProducer | None = ctx.data.pop("producer", None)
    if producer is None:
        return
    committed = await asyncio.to_thread(producer.stop)
    ctx.expect.update(dict.fromkeys(committed, ob.CONFIRMED))
    ctx.note(f"rows: {ctx.rows} of the batch, {len(committed)} from the steady producer")
    ctx.rows = ctx.result.rows = len(ctx.expect)


async def kills_accounted(ctx: Ctx) -> None:
    held_at: list[int] = ctx.data.get("held_at", [])
    kills = sum(1 for n in held_at if n)
    ctx.check(
        f"{kills} kills with publishes outstanding (in flight at each kill: {held_at})",
        kills >= ctx.data.get("kills", 5),
    )
    await exactly_once(ctx)


# ---------------------------------------------------------------- 21b: broker kill -9


def kill_broker(times: int) -> Step:
    """21b: ``kill -9`` of the private broker's VM mid-drain and a restart, ``times`` in a row
    (the next once the drain moved on by 1 % of the rows, or after 20 s)."""

    async def inject(ctx: Ctx) -> None:
        await ctx.fault_now(f"kill -9 of the broker and a restart, {times} times")
        for turn in range(times):
            before = (await ctx.counts()).get("confirmed", 0)
            pid = await asyncio.to_thread(ctx.services.kill_broker)
            if turn == 0:
                await ctx.landed()
            await asyncio.sleep(1.0 if times == 1 else 0.5)
            began = time.monotonic()
            await asyncio.to_thread(ctx.services.start_rabbitmq)
            ctx.note(f"kill {turn + 1}: pid {pid}, restarted in {time.monotonic() - began:.1f}s")
            if turn == times - 1:
                break
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if (await ctx.counts()).get("confirmed", 0) >= before + ctx.rows // 100:
                    break
                await asyncio.sleep(0.1)

    return inject


async def reconnected_exactly_once(ctx: Ctx) -> None:
    logs = _logs(ctx)
    ends = len(re.findall(r"the stream connection ended", logs))
    ctx.check(f"the stream relay reconnected ({ends} connections ended)", ends >= 1)
    await exactly_once(ctx)


# ---------------------------------------------------------------- 21c: the cluster's leader


async def three_members(ctx: Ctx, *, via: int, timeout: float = 60) -> int:
    """The stream's leader once the metadata shows it with two replicas (a node just started
    may not hold its replica yet: a leader killed then would leave no majority)."""
    deadline = time.monotonic() + timeout
    while True:
        leader = await leader_node(ctx, via=via, timeout=timeout)
        if leader is not None and len(ctx.data.get("replicas", [])) == 2:
            return leader
        if time.monotonic() > deadline:
            raise ScenarioError(
                f"stream {ctx.names['stream']}: leader {leader}, replicas "
                f"{ctx.data.get('replicas')} after {timeout:.0f}s (want three members)"
            )
        await asyncio.sleep(0.5)


async def declare_on_any_node(ctx: Ctx) -> None:
    """21c prepare: the stream declared through a node picked at random (its first leader is,
    as a rule, the node it was declared on)."""
    ctx.verifier_url = ctx.cluster.node_url(random.choice((1, 2, 3)))


async def find_the_leader(ctx: Ctx) -> None:
    """21c setup: the stream's leader (``query_leader_and_replicas``); the publisher's stream URL
    names another node (picked at random), the final read goes through the survivors."""
    ctx.result.allowed = 0
    leader = await three_members(ctx, via=random.choice((1, 2, 3)))
    others = [n for n in (1, 2, 3) if n != leader]
    via = random.choice(others)
    ctx.data.update(leader=leader, via=via)
    ctx.publisher_env["OUTBOX_STREAM_URL"] = node_stream_url(ctx.cluster, via)
    ctx.data["read_urls"] = [node_stream_url(ctx.cluster, n) for n in [*others, leader]]
    ctx.note(
        f"stream led by node {leader}, replicas on nodes {ctx.data.get('replicas')}; the "
        f"publisher's stream URL names node {via}"
    )


async def _kill_leader(ctx: Ctx, leader: int, *, via: int) -> int | None:
    """``kill -9`` of node ``leader``; the node elected after it (None: none within 120 s)."""
    await asyncio.to_thread(ctx.cluster.kill, leader)
    killed = time.monotonic()
    await ctx.landed()
    node = await leader_node(ctx, via=via, timeout=120, not_=leader)
    after = round(time.monotonic() - killed, 2)
    ctx.data.setdefault("elections", []).append(after if node is not None else None)
    if node is None:
        ctx.note(f"no other node led the stream within 120s of node {leader}'s kill")
    else:
        ctx.note(f"node {node} leads the stream {after}s after node {leader}'s kill")
    return node


async def kill_the_stream_leader(ctx: Ctx) -> None:
    """21c. ``kill -9`` of the node leading the stream; wait for another to lead it."""
    leader, via = ctx.data["leader"], ctx.data["via"]
    await ctx.fault_now(f"kill -9 of node {leader}, the stream's leader")
    ctx.data["new_leader"] = await _kill_leader(ctx, leader, via=via)


def kill_stream_leaders(times: int) -> Step:
    """21c-long: ``times`` in a row, ``kill -9`` of the stream's leader, wait for a new one and
    for the drain to move on, start the killed node again (three replicas for the next kill).
    The leader may be the node the publisher's stream URL names: then the relay has no node to
    ask until it is back."""

    async def inject(ctx: Ctx) -> None:
        leader, via = ctx.data["leader"], ctx.data["via"]
        await ctx.fault_now(f"kill -9 of the stream's leader, {times} times")
        for turn in range(times):
            ctx.data["leader"] = leader  # the last one killed
            ask = via if via != leader else next(n for n in (1, 2, 3) if n != leader)
            new = await _kill_leader(ctx, leader, via=ask)
            ctx.data["new_leader"] = new
            target = (await ctx.counts()).get("confirmed", 0) + ctx.rows // 50
            if leader != via:  # else the rows wait for the publisher's node
                with contextlib.suppress(ScenarioError):
                    await ctx.wait_counts(
                        lambda c, t=target: c.get("confirmed", 0) >= t,
                        timeout=60,
                        what=f"the drain moving on after kill {turn + 1}",
                    )
            began = time.monotonic()
            await asyncio.to_thread(ctx.cluster.start_node, leader)
            started = time.monotonic() - began
            if new is None:
                return
            leader = await three_members(ctx, via=via)
            ctx.note(
                f"kill {turn + 1}: the node started again in {started:.1f}s, the stream with "
                f"three members {time.monotonic() - began:.1f}s after the start command"
            )

    return inject


async def new_leader_and_exactly_once(ctx: Ctx) -> None:
    ctx.check(
        f"another node leads the stream (node {ctx.data.get('new_leader')}, "
        f"node {ctx.data.get('leader')} killed)",
        ctx.data.get("new_leader") is not None,
    )
    counts = await ctx.counts()
    ctx.check(
        f"rows waited through the election: none failed ({dict(counts)})",
        not counts.get("failed", 0),
    )
    await exactly_once(ctx)


# ---------------------------------------------------------------- the account


def _logs(ctx: Ctx) -> str:
    return "".join(p.log_text() for p in ctx.publishers)


async def exactly_once(ctx: Ctx) -> None:
    """After the publishers stopped: the whole stream read from its first offset, each expected
    id in it exactly once, nothing else in it; every row confirmed. And what the relay's log
    says it did to get there (lanes taken over, rows the broker had, rows sent again)."""
    verifier: StreamVerifier = ctx.data["stream_verifier"]
    verifier.expected = set(ctx.expect)
    got = await verifier.read()
    copies = collections.Counter(got.values())
    expected = set(ctx.expect)
    missing = expected - set(copies)
    extra = sum(n - 1 for n in copies.values() if n > 1)
    stray = set(copies) - expected
    ctx.note(
        f"stream read whole through {verifier.read_from}: {len(got)} messages at offsets "
        f"{min(got, default=None)}-{max(got, default=None)}; {len(missing)} ids missing, "
        f"{extra} extra copies, {len(stray)} foreign ids"
    )
    ctx.check(
        f"each of the {len(expected)} message ids in the stream exactly once",
        not missing and not extra and not stray,
    )
    counts = await ctx.counts()
    ctx.check(
        f"every row confirmed ({counts.get('confirmed', 0)} of {len(expected)})",
        counts.get("confirmed", 0) == len(expected) == sum(counts.values()),
    )
    logs = _logs(ctx)
    settled = sum(int(n) for n in re.findall(r": (\d+) rows the broker already had", logs))
    again = sum(int(n) for n in re.findall(r"had settled, (\d+) sent again", logs))
    ctx.note(
        f"relay: {logs.count('(taken over)')} lanes taken over, {settled} rows the broker "
        f"already had settled without a publish, {again} sent again under their ids, "
        f"{logs.count('the stream connection ended')} connections ended"
    )


# ---------------------------------------------------------------- the scenarios


def _stream(key: str, title: str, proves: str, inject: Step, **kw: Any) -> Scenario:
    kw.setdefault("setup", on_private_broker)
    kw.setdefault("produce", write_batch)
    return Scenario(
        key, title, proves, inject, topology=stream_topology, verifier=stream_verifier, **kw
    )


SCENARIOS: list[Scenario] = [
    _stream(
        "21a",
        "stream: kill -9 of the publisher, five times, publishes outstanding",
        "a lane taken over after a crash asks the broker its last stored id: rows it had are "
        "settled, the others sent again under their ids; each message in the stream once",
        kill_publishers(5),
        trigger=0.05,
        flow=30.0,
        env=STREAM_ENV,
        verify=kills_accounted,
        # make test's test_streams.py kills ten publishers into a stream; 21a-long twenty
        long=True,
    ),
    _stream(
        "21b",
        "stream: broker kill -9 and restart mid-drain",
        "the relay reconnects to the restarted broker and resumes each lane from the stored "
        "id: nothing confirmed lost, nothing appended twice",
        kill_broker(1),
        flow=8.0,
        env=STREAM_ENV,
        verify=reconnected_exactly_once,
    ),
    _stream(
        "21c",
        "stream: cluster, kill -9 of the stream's leader node",
        "a stream of three replicas elects a new leader; rows wait, then the relay resumes "
        "on it from the stored id: each message once, none failed",
        kill_the_stream_leader,
        cluster=True,
        prepare=declare_on_any_node,
        setup=find_the_leader,
        trigger=0.2,
        flow=10.0,
        env=CLUSTER_STREAM_ENV,
        verify=new_leader_and_exactly_once,
    ),
    _stream(
        "21c-long",
        "stream: cluster, kill -9 of the stream's leader node, three times in a row",
        "three leader changes under one drain (each killed node started again before the "
        "next kill, the publisher's own node among them when it leads): each message once",
        kill_stream_leaders(3),
        cluster=True,
        prepare=declare_on_any_node,
        setup=find_the_leader,
        trigger=0.05,
        flow=90.0,
        env=CLUSTER_STREAM_ENV,
        verify=new_leader_and_exactly_once,
        long=True,
        timeout=480.0,
    ),
    _stream(
        "21a-long",
        "stream: kill -9 of the publisher, twenty times, under a steady producer",
        "21a for two minutes: twenty takeovers, rows arriving all along; each message once",
        kill_publishers(20),
        produce=write_batch_and_produce,
        trigger=0.02,
        flow=120.0,
        env=STREAM_ENV,
        verify=kills_accounted,
        teardown=stop_producing,
        long=True,
        timeout=480.0,
    ),
    _stream(
        "21b-long",
        "stream: broker kill -9 and restart, ten times in a row, under one drain",
        "ten crashes of the broker under one drain: the relay resumes every lane each time; "
        "each message once",
        kill_broker(10),
        trigger=0.05,
        flow=120.0,
        env=STREAM_ENV,
        verify=reconnected_exactly_once,
        long=True,
        timeout=480.0,
    ),
]
