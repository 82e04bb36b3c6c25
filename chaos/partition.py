"""Scenario 20: a real network partition of the three-node RabbitMQ cluster (nodes in network
namespaces of the scenario's own, see ``deploy/local/netns-cluster.sh``).

The publisher is connected to node 1 or 2 (its URL names those two, in a random order); the
verifier and the topology use node 3, which is never cut. The publisher's node is cut off from
its two peers for :data:`CUT` seconds while the root namespace, where the publisher runs, still
reaches it. No confirm can come through the cut node (the quorum queue's majority is on the
other side), so the publisher must leave it, on its confirm timeout or when ``pause_minority``
pauses the node and drops its connections, and go on with the other node of its URL,
republishing (and counting) what the cut node never confirmed. Healed, the cut node must rejoin,
its quorum queue member come back online, and it must take connections again.

Rows are due evenly over 90 s (10,000 by default): the cut comes at a fifth of them, rows flow
through the cut and through the heal. One run takes about two minutes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime as dt
import itertools
import json
import os
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from chaos import amqp
from chaos import outbox as ob
from chaos.amqp import Topology
from chaos.runner import Ctx, Scenario, ScenarioError, default_topology
from chaos.scenarios import CLUSTER_ENV
from chaos.services import REPO, ServiceError, run_script

SCRIPT = REPO / "deploy" / "local" / "netns-cluster.sh"
NODES = (1, 2, 3)
#: how long the publisher's node stays cut off from its peers
CUT = 60.0
#: the node the verifier and the topology use: never cut
VERIFIER_NODE = 3


@dataclass
class NetnsCluster:
    """The three-node cluster in network namespaces, driven through ``netns-cluster.sh``. Node
    addresses come from the script's ``env`` (one place for them). The first :meth:`ensure`
    registers an ``atexit`` stop: the matrix's ``MatrixEnv.close`` knows only its own cluster."""

    local_dir: str
    _hosts: tuple[str, ...] = field(default=(), init=False, repr=False)
    _stop_registered: bool = field(default=False, init=False, repr=False)

    @classmethod
    def for_matrix(cls) -> NetnsCluster:
        return cls(local_dir=str(REPO / ".local" / "chaos"))

    def run(self, *args: str, timeout: float = 180) -> str:
        return run_script(SCRIPT, *args, local_dir=self.local_dir, timeout=timeout)

    # ------------------------------------------------------------ addresses

    @property
    def hosts(self) -> tuple[str, ...]:
        """``address:port`` of nodes 1, 2, 3, from ``netns-cluster.sh env``."""
        if not self._hosts:
            line = next(ln for ln in self.run("env").splitlines() if "OUTBOX_AMQP_URL=" in ln)
            self._hosts = tuple(line.split("@", 1)[1].rstrip("/").split(","))
        return self._hosts

    def url_of(self, nodes: tuple[int, ...]) -> str:
        return f"amqp://guest:guest@{','.join(self.hosts[n - 1] for n in nodes)}/"

    def node_url(self, node: int) -> str:
        return self.url_of((node,))

    def node_name(self, node: int) -> str:
        """The Erlang node name of node N (long names: ``rabbit@<its address>``)."""
        return "rabbit@" + self.hosts[node - 1].rsplit(":", 1)[0]

    def node_of(self, host: str) -> int | None:
        """The node at ``address:port`` (as the publisher reports it), None if not ours."""
        return self.hosts.index(host) + 1 if host in self.hosts else None

    # ------------------------------------------------------------ the script

    def ensure(self) -> None:
        """Start what is missing (network and nodes); stop it all when this process exits."""
        if os.geteuid() != 0:
            raise ScenarioError("the partition scenario needs root (ip netns, veth, bridge)")
        if not self._stop_registered:
            atexit.register(self.stop_quietly)
            self._stop_registered = True
        Path(self.local_dir).mkdir(parents=True, exist_ok=True)
        self.run("start", timeout=300)

    def stop(self) -> None:
        self.run("stop", timeout=300)

    def stop_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()

    def cut(self, node: int) -> None:
        self.run("cut", str(node))

    def heal(self, node: int) -> None:
        self.run("heal", str(node))

    def ctl(self, node: int, *args: str, timeout: float = 30) -> str:
        return self.run("ctl", str(node), *args, timeout=timeout)

    def leader(self, queue: str) -> int | None:
        with contextlib.suppress(ServiceError, subprocess.TimeoutExpired, ValueError):
            return int(self.run("leader", queue, timeout=60).strip())
        return None

    # ------------------------------------------------------------ what a node says

    def serving(self, node: int) -> bool:
        """RabbitMQ runs on node N (False while pause_minority holds it, or if it does not
        answer)."""
        with contextlib.suppress(ServiceError, subprocess.TimeoutExpired):
            return self.ctl(node, "eval", "rabbit:is_running().").strip() == "true"
        return False

    def vm_up(self, node: int) -> bool:
        with contextlib.suppress(ServiceError, subprocess.TimeoutExpired):
            return self.ctl(node, "eval", "ok.").strip() == "ok"
        return False

    def running_nodes(self, node: int) -> int:
        """How many nodes node N sees running (0 if it does not answer)."""
        try:
            out = self.ctl(node, "cluster_status", "--formatter", "json")
        except (ServiceError, subprocess.TimeoutExpired):
            return 0
        return len(json.loads(out).get("running_nodes", []))

    def online_members(self, node: int, queue: str) -> int:
        """How many of the quorum queue's members node N reports online (0 if unknown)."""
        try:
            out = self.ctl(node, "list_queues", "name", "online", "--formatter", "json")
        except (ServiceError, subprocess.TimeoutExpired):
            return 0
        for q in json.loads(out or "[]"):
            if q.get("name") == queue:
                return len(q.get("online") or [])
        return 0


NETNS = NetnsCluster.for_matrix()


# ---------------------------------------------------------------- scenario 20


def quorum_topology(ctx: Ctx) -> Topology:
    return default_topology(ctx, {"x-queue-type": "quorum"})


async def start_the_netns_cluster(ctx: Ctx) -> None:
    """20, prepare: the namespaced cluster up; the verifier (and the topology) on node 3, the
    publisher's URL names nodes 1 and 2 (its first node is the one to cut)."""
    await asyncio.to_thread(NETNS.ensure)
    ctx.verifier_url = NETNS.node_url(VERIFIER_NODE)
    ctx.publishers_url = NETNS.url_of(tuple(n for n in NODES if n != VERIFIER_NODE))


async def _publisher_node(ctx: Ctx, *, timeout: float = 20.0) -> int:
    """The node the publisher is connected to, from its own report (every second)."""
    name = ctx.publishers[0].name
    deadline = time.monotonic() + timeout
    while True:
        stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
        node = NETNS.node_of(str(stats.get(name, {}).get("broker_node") or ""))
        if node is not None:
            return node
        if time.monotonic() > deadline:
            raise ScenarioError(f"publisher {name} reported no node of ours in {timeout:.0f}s")
        await asyncio.sleep(0.2)


async def _poll(check: Callable[[], Awaitable[bool]], *, timeout: float) -> float | None:
    """Seconds until ``check`` holds (polled), None if it did not within ``timeout``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if await check():
            return round(time.monotonic() - began, 1)
        await asyncio.sleep(0.2)
    return None


def _amqp_open(node: int) -> bool:
    """Does node N accept a TCP connection on its AMQP port (from the root namespace)?"""
    address, port = NETNS.hosts[node - 1].rsplit(":", 1)
    try:
        with socket.create_connection((address, int(port)), timeout=1):
            return True
    except OSError:
        return False


async def _paused(node: int) -> bool:
    """pause_minority holds node N: its VM answers, RabbitMQ is stopped, its listener closed."""
    if await asyncio.to_thread(_amqp_open, node):
        return False
    serving, vm_up = await asyncio.gather(
        asyncio.to_thread(NETNS.serving, node), asyncio.to_thread(NETNS.vm_up, node)
    )
    return vm_up and not serving


async def _takes_a_channel(node: int) -> bool:
    try:
        async with amqp.channel(NETNS.node_url(node)):
            return True
    except Exception:
        return False


async def _rejoined(ctx: Ctx, node: int) -> dict[str, bool]:
    """What must hold after the heal, each part on its own."""
    queue = ctx.names["queue"]
    serving, seen_by_cut, seen_by_3, online = await asyncio.gather(
        asyncio.to_thread(NETNS.serving, node),
        asyncio.to_thread(NETNS.running_nodes, node),
        asyncio.to_thread(NETNS.running_nodes, VERIFIER_NODE),
        asyncio.to_thread(NETNS.online_members, VERIFIER_NODE, queue),
    )
    return {
        f"node {node} runs RabbitMQ again": serving,
        f"node {node} and node {VERIFIER_NODE} each see 3 running nodes": (
            seen_by_cut == 3 and seen_by_3 == 3
        ),
        "the quorum queue has its 3 members online": online == 3,
        f"node {node} takes AMQP connections again": await _takes_a_channel(node),
    }


async def _moved_off(ctx: Ctx, node: int, *, timeout: float) -> tuple[int, float] | None:
    """The node the publisher reports once it is off ``node``, and after how many seconds."""
    name = ctx.publishers[0].name
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
        now = NETNS.node_of(str(stats.get(name, {}).get("broker_node") or ""))
        if now is not None and now != node:
            return now, round(time.monotonic() - began, 1)
        await asyncio.sleep(0.2)
    return None


async def cut_the_publishers_node(ctx: Ctx) -> None:
    """20. The publisher's node cut off from its peers for CUT s, then healed; the node must
    pause, the publisher move, and the node come back."""
    node = await _publisher_node(ctx)
    ctx.data["cut_node"] = node
    leader = await asyncio.to_thread(NETNS.leader, ctx.names["queue"])
    ctx.note(f"quorum queue's leader before the cut: node {leader}")
    await ctx.fault_now(f"node {node}, the publisher's, cut off from its peers for {CUT:.0f}s")
    began = time.monotonic()
    await asyncio.to_thread(NETNS.cut, node)
    try:
        await ctx.landed()
        await _while_cut(ctx, node)
        await asyncio.sleep(max(0.0, CUT - (time.monotonic() - began)))
    finally:
        await asyncio.to_thread(NETNS.heal, node)
        ctx.data["healed_wall"] = time.time()
    await _after_heal(ctx, node)


async def lead_then_cut(ctx: Ctx) -> None:
    """20b. The quorum queue's leadership moved to the publisher's node, then that node cut
    off: the leader is on the minority side, the majority elects a new one."""
    node = await _publisher_node(ctx)
    queue = ctx.names["queue"]
    expr = (
        f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>)), '
        f"rabbit_quorum_queue:transfer_leadership(Q, '{NETNS.node_name(node)}')."
    )
    out = await asyncio.to_thread(NETNS.ctl, VERIFIER_NODE, "eval", expr)
    leader = await _poll_leader(ctx, node)
    ctx.note(f"transfer_leadership to node {node}: {out.strip()}; leader now node {leader}")
    ctx.check(f"the quorum queue's leader moved to node {node}, the one to be cut", leader == node)
    await cut_the_publishers_node(ctx)
    after = await asyncio.to_thread(NETNS.leader, queue)
    ctx.check(f"a new leader on the majority (node {after})", after is not None and after != node)


async def _poll_leader(ctx: Ctx, node: int, timeout: float = 15.0) -> int | None:
    deadline = time.monotonic() + timeout
    leader = None
    while time.monotonic() < deadline:
        leader = await asyncio.to_thread(NETNS.leader, ctx.names["queue"])
        if leader == node:
            return leader
        await asyncio.sleep(0.5)
    return leader


async def _while_cut(ctx: Ctx, node: int) -> None:
    """The cut node pauses and the publisher moves, each timed from the cut (polled together:
    the publisher may leave before the node pauses, on its confirm timeout)."""
    paused, moved = await asyncio.gather(
        _poll(lambda: _paused(node), timeout=40), _moved_off(ctx, node, timeout=CUT - 5)
    )
    ctx.note(
        f"node {node} paused {paused}s after the cut"
        if paused is not None
        else f"node {node} still serving 40s after the cut"
    )
    ctx.check(
        f"node {node} paused (pause_minority: RabbitMQ stopped, AMQP listener closed)",
        paused is not None,
    )
    ctx.note(
        f"publisher reports node {moved[0]} {moved[1]}s after the cut (reported every 1 s)"
        if moved
        else f"publisher still reports node {node} {CUT - 5:.0f}s after the cut"
    )
    ctx.check(f"the publisher moved off node {node} to the majority", moved is not None)


async def _after_heal(ctx: Ctx, node: int) -> None:
    parts: dict[str, bool] = {}

    async def back() -> bool:
        nonlocal parts
        parts = await _rejoined(ctx, node)
        return all(parts.values())

    took = await _poll(back, timeout=90)
    ctx.note(
        f"node {node} back (rejoined, queue members online, serving) {took}s after the heal"
        if took is not None
        else f"node {node} not back 90s after the heal: {parts}"
    )
    for name, ok in parts.items():
        ctx.check(f"after the heal: {name}", ok)


def _stall_around_cut(ctx: Ctx, rows: list[ob.FinalRow]) -> tuple[float, float] | None:
    """The longest stretch without a confirm between the cut and the heal: (its start, its
    end), in seconds from the cut. Its end is when the drain resumed on the majority."""
    if ctx.fault_wall is None:
        return None
    start = dt.datetime.fromtimestamp(ctx.fault_wall, tz=dt.UTC)
    end = dt.datetime.fromtimestamp(ctx.data.get("healed_wall", time.time()), tz=dt.UTC)
    stamps = sorted(
        r.confirmed_at for r in rows if r.confirmed_at and start <= r.confirmed_at < end
    )
    if not stamps:
        return None
    a, b = max(itertools.pairwise([start, *stamps]), key=lambda p: p[1] - p[0])
    return (a - start).total_seconds(), (b - start).total_seconds()


async def partition_accounted(ctx: Ctx) -> None:
    """20, after: when the drain resumed, what the publisher counted, where the leader is."""
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    stall = _stall_around_cut(ctx, rows)
    if stall is not None:
        ctx.note(
            f"confirms stalled from +{stall[0]:.2f}s to +{stall[1]:.2f}s after the cut: "
            f"the drain resumed on the majority {stall[1]:.1f}s after the cut"
        )
    ctx.check(
        f"the drain resumed before the heal (within {CUT:.0f}s of the cut)",
        stall is not None and stall[1] < CUT,
    )
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    total = {
        k: sum(int(s.get(k, 0)) for s in stats.values())
        for k in ("reconnects", "confirm_timeouts", "nacked", "destination_outages")
    }
    republished = sum(r.lost_confirms for r in rows)
    ctx.note(
        f"rows republished (lost_confirms) {republished}; rows sent more than once "
        f"{sum(1 for r in rows if r.attempts > 1)}; publisher counters {total}"
    )
    ctx.check("publisher reconnected", total["reconnects"] >= 1)
    ctx.check("no row spent its nack budget (nacks 0 on every row)", not any(r.nacks for r in rows))
    leader = await asyncio.to_thread(NETNS.leader, ctx.names["queue"])
    ctx.note(f"quorum queue's leader after the heal: node {leader}")


async def heal_and_restore(ctx: Ctx) -> None:
    """20, teardown: never leave a node cut off; every node running for the next run (the
    cluster itself stays up until the process exits)."""
    node = ctx.data.get("cut_node")
    if node is not None and "healed_wall" not in ctx.data:
        await asyncio.to_thread(NETNS.heal, node)
    await asyncio.to_thread(NETNS.ensure)


SCENARIOS: list[Scenario] = [
    Scenario(
        "20",
        "cluster partition: the publisher's node cut off from its peers for 60 s, healed",
        "nodes in network namespaces, pause_minority, a quorum queue: the cut node pauses and "
        "drops its clients; the publisher moves to the majority and republishes what the cut "
        "node never confirmed (counted); nothing lost; healed, the node rejoins and serves",
        cut_the_publishers_node,
        prepare=start_the_netns_cluster,
        topology=quorum_topology,
        verify=partition_accounted,
        teardown=heal_and_restore,
        # rows due evenly over 90 s: the cut comes at a fifth of them (about 18 s in), the
        # heal 60 s later, and rows still flow for the last 12 s
        flow=90.0,
        trigger=0.2,
        env=CLUSTER_ENV,
        timeout=300,
    ),
    Scenario(
        "20b",
        "cluster partition: the quorum queue's leader and the publisher cut off together",
        "the leader on the minority side: the majority elects a new one while the publisher "
        "moves; confirms resume on the majority, every republish counted, nothing lost",
        lead_then_cut,
        prepare=start_the_netns_cluster,
        topology=quorum_topology,
        verify=partition_accounted,
        teardown=heal_and_restore,
        flow=90.0,
        trigger=0.2,
        env=CLUSTER_ENV,
        long=True,
        timeout=300,
    ),
]
