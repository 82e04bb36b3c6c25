"""The scenarios of the fault matrix: one fault each, injected while rows flow.

Each is a :class:`~chaos.runner.Scenario`: what it breaks (``inject``), the publisher settings it
needs, and where its rows must end. The runner does the rest (batch, verifier, drain, accounting).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pamqp.commands import Basic

from chaos import amqp, kit_handler
from chaos import outbox as ob
from chaos.amqp import Topology
from chaos.outbox import Expect, PlannedRow
from chaos.producer import SteadyProducer
from chaos.proxy import TcpProxy
from chaos.runner import (
    OPEN,
    Ctx,
    Scenario,
    ScenarioError,
    Step,
    default_plan,
    default_topology,
    insert_batch,
)
from chaos.services import ArmedEval
from chaos.spark import produce_with_spark

LEASE = 3  # seconds; the kill scenarios wait for it to expire
KIT_LIMIT = 3  # the consumer kit's delivery limit in 15, 15b, 15c
REPO = Path(__file__).resolve().parents[1]


def _env(**values: object) -> dict[str, str]:
    return {f"OUTBOX_{k.upper()}": str(v) for k, v in values.items()}


async def _reconnected(ctx: Ctx) -> None:
    """Check, from the publishers' own counters, that they reconnected."""
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    total = sum(int(s.get("reconnects", 0)) for s in stats.values())
    ctx.check(f"publisher reconnected ({total} reconnects counted)", total >= 1)


# ---------------------------------------------------------------- 1, 2, 12: publisher crashes


async def kill_after_publish(ctx: Ctx) -> None:
    """1. Many rows published and acked, the acks not yet in the DB (flush every 0.5 s): kill."""
    want = min(ctx.scenario.window // 2, (ctx.rows - ctx.rows * 3 // 10) // 2)
    await ctx.wait_counts(
        lambda c: c.get("in_flight", 0) >= want, timeout=30, what=f"{want} rows in flight"
    )
    await ctx.fault_now("kill -9 of the publisher with its window out")
    await ctx.kill9(ctx.publishers[0])
    await ctx.landed()
    held = await asyncio.to_thread(ctx.snapshot_in_flight)
    ctx.note(f"{len(held)} rows in flight at the kill")
    ctx.check("rows were in flight at the kill", len(held) > 0)
    ctx.result.allowed = min(ctx.result.allowed, len(held))
    await ctx.spawn_publisher()


async def kill_after_claim(ctx: Ctx) -> None:
    """2. Publishes stop leaving (proxy black-holed) while the publisher keeps claiming; kill."""
    assert ctx.proxy is not None
    ctx.proxy.blackhole(new=True)
    window = ctx.scenario.window
    await ctx.wait_counts(
        lambda c: c.get("in_flight", 0) >= window * 0.7,
        timeout=20,
        what="a full window of claimed rows",
    )
    await asyncio.sleep(0.5)
    await ctx.fault_now("kill -9 of the publisher holding claimed, unsent rows")
    await ctx.kill9(ctx.publishers[0])
    kill_wall = time.time()
    await ctx.landed()
    held = await asyncio.to_thread(ctx.snapshot_in_flight)
    ctx.note(f"{len(held)} rows claimed and in flight at the kill")
    ctx.check("claimed rows were held at the kill", len(held) > 0)
    ctx.proxy.heal()
    ctx.data.update(held=held, kill_wall=kill_wall)
    await ctx.spawn_publisher()


async def check_lease_wait(ctx: Ctx) -> None:
    """2, after the drain: no row held at the kill came back before its lease expired."""
    held: set[str] = ctx.data.get("held", set())
    if not held:
        return
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    times = [
        r.confirmed_at.timestamp()
        for r in rows
        if r.message_id in held and r.confirmed_at is not None
    ]
    if times:
        waited = min(times) - ctx.data["kill_wall"]
        ctx.note(f"first held row confirmed {waited:.1f}s after the kill (lease {LEASE}s)")
        ctx.check("held rows waited for their lease to expire", waited >= LEASE - 1.2)


async def kill_one_of_two(ctx: Ctx, *, min_held: int = 50) -> None:
    """12. Two publishers share the outbox (SKIP LOCKED claims); one dies."""
    victim = ctx.publishers[0]
    deadline = time.monotonic() + 30
    while len(await asyncio.to_thread(ctx.snapshot_in_flight, victim.name)) < min_held:
        if time.monotonic() > deadline:
            raise ScenarioError(f"{victim.name} never held {min_held} rows")
        await asyncio.sleep(0.02)
    # the kill at once, the bookkeeping after: a count between the two let the victim's
    # write-back settle every row it held (CI, 2026-11-27: 0 held at the kill)
    await ctx.kill9(victim)
    await ctx.fault_now("kill -9 of one of two publishers")
    await ctx.landed()
    held = await asyncio.to_thread(ctx.snapshot_in_flight, victim.name)
    ctx.note(f"{len(held)} rows in flight at {victim.name} at the kill")
    ctx.check("the killed publisher held rows", len(held) > 0)
    ctx.dup_scope = held
    ctx.result.allowed = min(ctx.result.allowed, len(held))


# ---------------------------------------------------------------- 14: per-key order

ORDER_KEYS = 400


def ordered_plan(ctx: Ctx) -> list[PlannedRow]:
    """Rows of ORDER_KEYS keys, interleaved as a stream would write them; ids follow each
    key's sequence (the row's index within its key is in its message id)."""
    ex, rk = ctx.names["exchange"], "rk"
    return [
        PlannedRow(
            f"{ctx.run}-k{i % ORDER_KEYS:03d}-{i // ORDER_KEYS:05d}",
            ex,
            rk,
            ob.body_for(i),
            ordering_key=f"k{i % ORDER_KEYS:03d}",
        )
        for i in range(ctx.rows)
    ]


async def kill_one_of_two_ordered(ctx: Ctx) -> None:
    """14. Two publishers drain ordered keys; one is killed with its window out, a restart of
    the broker follows; the survivor and a new publisher finish."""
    await kill_one_of_two(ctx, min_held=20)  # one row per key in flight: fewer held at once
    await asyncio.sleep(0.5)
    # the broker's death loses the survivor's unconfirmed publishes too: those may be duplicated
    # read under a lock that holds claims until the broker is dead: a row claimed between the
    # read and the kill would be on the wire unseen
    kill = ctx.services.kill_broker
    exposed, pid = await asyncio.to_thread(ob.in_flight_during, ctx.engine, kill)
    ctx.dup_scope = (ctx.dup_scope or set()) | exposed
    ctx.result.allowed = len(ctx.dup_scope)
    ctx.note(f"{len(exposed)} rows in flight at the broker kill (possible duplicates too)")
    ctx.note(f"then killed the broker (pid {pid})")
    await asyncio.sleep(1)
    began = time.monotonic()
    await asyncio.to_thread(ctx.services.start_rabbitmq)
    ctx.note(f"broker restarted in {time.monotonic() - began:.1f}s")
    await ctx.spawn_publisher()


async def check_key_order(ctx: Ctx) -> None:
    """14, after the drain: for every key, the first deliveries came in the key's order."""
    assert ctx.verifier is not None
    arrivals = await asyncio.to_thread(ctx.verifier.first_arrivals)
    by_key: dict[str, list[int]] = {}
    for mid in arrivals:
        key, seq = mid.rsplit("-", 2)[-2:]
        by_key.setdefault(key, []).append(int(seq))
    broken = sorted(k for k, seqs in by_key.items() if seqs != sorted(seqs))
    ctx.note(f"{len(by_key)} keys, {len(arrivals)} first deliveries checked for order")
    every = len(by_key) == min(ORDER_KEYS, ctx.rows)
    ctx.check(
        f"every key's first deliveries in its order ({len(broken)} keys out of order: "
        f"{broken[:5]})",
        not broken and every,
    )


# ---------------------------------------------------------------- 16: a frozen publisher


def _confirmed_count(ctx: Ctx) -> int:
    return sum(1 for r in ob.final_rows(ctx.engine) if r.status == "confirmed")


async def freeze_one_of_two(ctx: Ctx) -> None:
    """16. Two publishers drain ordered keys; one is frozen with SIGSTOP (a GC pause, a VM
    migration, a debugger) for two leases, then resumed. While it is frozen the other's keys
    move, and the frozen one's rows come back within one lease (plus a sweep's interval)."""
    victim = ctx.publishers[0]
    deadline = time.monotonic() + 30
    while len(await asyncio.to_thread(ctx.snapshot_in_flight, victim.name)) < 20:
        if time.monotonic() > deadline:
            raise ScenarioError(f"{victim.name} never held 20 rows")
        await asyncio.sleep(0.02)
    await ctx.fault_now(f"SIGSTOP of one of two publishers for {2 * LEASE} s (lease {LEASE} s)")
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        await ctx.landed()
        held = await asyncio.to_thread(ctx.snapshot_in_flight, victim.name)
        before = await asyncio.to_thread(_confirmed_count, ctx)
        back_by = time.monotonic() + LEASE + LEASE / 2 + 1.5  # its lease, the sweep's interval
        still: set[str] = held
        while time.monotonic() < back_by and still:
            await asyncio.sleep(0.2)
            still = await asyncio.to_thread(ctx.snapshot_in_flight, victim.name)
        waited = LEASE + LEASE / 2 + 1.5 - (back_by - time.monotonic())
        moved = await asyncio.to_thread(_confirmed_count, ctx) - before
        ctx.note(
            f"{len(held)} rows in flight at the frozen publisher; {len(still)} still held "
            f"after {waited:.1f}s; {moved} rows confirmed by the other meanwhile"
        )
        ctx.check("the frozen publisher's rows came back within its lease and a sweep", not still)
        ctx.check("the other publisher's keys moved while one was frozen", moved > 0)
        ctx.dup_scope = held
        ctx.result.allowed = min(ctx.result.allowed, len(held))
        await asyncio.sleep(max(0.0, 2 * LEASE - waited))
    finally:
        os.kill(victim.pid, signal.SIGCONT)


# ---------------------------------------------------------------- 15: the receiving end


def kit_topology(ctx: Ctx) -> Topology:
    """The verifier's queue, and a second queue bound the same way for the consumer kit."""
    ex, q = ctx.names["exchange"], ctx.names["queue"]
    ctx.names["kit"] = f"{q}.kit"
    return Topology(
        exchanges=[ex],
        queues={q: {}, ctx.names["kit"]: {}},
        bindings=[(ex, q, "rk"), (ex, ctx.names["kit"], "rk")],
        unverified=(ctx.names["kit"],),
    )


def kit_dlq_topology(ctx: Ctx) -> Topology:
    """:func:`kit_topology` with the kit's queue dead-lettering into ``<kit>.dlq``."""
    topo = kit_topology(ctx)
    kit = ctx.names["kit"]
    topo.queues[kit] = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{kit}.dlq"}
    topo.queues[f"{kit}.dlq"] = {}
    topo.unverified = (kit, f"{kit}.dlq")
    return topo


def _spawn_kit(ctx: Ctx) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=ctx.data.get("kit_db_url", ctx.db_url), OUTBOX_AMQP_URL=ctx.amqp_url
    )
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    log = open(ctx.log_dir / f"kit-{len(ctx.data.get('kits', []))}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "consume",
            ctx.names["kit"],
            "--handler",
            "chaos.kit_handler:record",
            "--name",
            "chaos-kit",
            "--prefetch",
            "300",
            "--delivery-limit",
            str(KIT_LIMIT),
        ],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ctx.data.setdefault("kits", []).append(proc)
    return proc


def _kit_logs(ctx: Ctx) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(ctx.log_dir.glob("kit-*.log")))


async def _dead_letters(ctx: Ctx) -> list[str]:
    """The message ids in the kit's dead-letter queue."""
    ids = []
    async with amqp.channel(ctx.amqp_url) as ch:
        while True:
            got = await ch.basic_get(f"{ctx.names['kit']}.dlq", no_ack=True)
            if got is None or got.delivery is None or not hasattr(got.delivery, "delivery_tag"):
                return ids
            ids.append(str(got.header.properties.message_id))


async def start_the_kit(ctx: Ctx) -> None:
    """15, before the rows flow: the consumer kit runs and consumes before the first publish,
    so it is killed mid-flow however long its process takes to start (a kit started at the
    fault's trigger could miss the whole flow on a slow machine)."""
    await asyncio.to_thread(kit_handler.create, ctx.engine)
    kit = _spawn_kit(ctx)
    log = ctx.log_dir / "kit-0.log"
    deadline = time.monotonic() + 60
    while b"consuming" not in (log.read_bytes() if log.exists() else b""):
        if kit.poll() is not None or time.monotonic() > deadline:
            raise ScenarioError(f"the consumer kit did not start consuming (see {log.name})")
        await asyncio.sleep(0.05)


async def kill_the_consumer(ctx: Ctx) -> None:
    """15. The consumer kit (its own process, inbox in the outbox database) is killed with
    kill -9 while it holds deliveries whose effects committed and whose acks were not sent;
    a new one starts. The publisher drains meanwhile (the verifier reads its own queue)."""
    first = ctx.data["kits"][0]
    want = ctx.rows // 5  # the kit lags the publisher: this leaves rows still to flow
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(kit_handler.counts, ctx.engine))[1] < want:
        if first.poll() is not None or time.monotonic() > deadline:
            raise ScenarioError(f"the consumer kit did not reach {want} effects")
        await asyncio.sleep(0.01)
    await ctx.fault_now("kill -9 of the consumer kit mid-batch")
    first.kill()
    first.wait(timeout=30)
    await ctx.landed()
    _spawn_kit(ctx)


async def check_effects_once(ctx: Ctx) -> None:
    """15, after the drain: every confirmed row had its effect exactly once in the kit."""
    confirmed = sum(
        1 for r in await asyncio.to_thread(ob.final_rows, ctx.engine) if r.status == "confirmed"
    )
    deadline = time.monotonic() + 60
    total, distinct = await asyncio.to_thread(kit_handler.counts, ctx.engine)
    while distinct < confirmed and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        total, distinct = await asyncio.to_thread(kit_handler.counts, ctx.engine)
    ctx.note(
        f"consumer kit: {distinct} messages with an effect, {total} effects, "
        f"{confirmed} rows confirmed"
    )
    ctx.check("every confirmed row had its effect in the consumer kit", distinct == confirmed)
    ctx.check(f"no effect twice ({total - distinct} duplicates)", total == distinct)


async def kit_behind_a_proxy(ctx: Ctx) -> None:
    """15b, before the rows flow: the kit reaches its database through a proxy of its own."""
    from sqlalchemy import make_url

    proxy = TcpProxy("127.0.0.1", ctx.services.pg_port)
    await proxy.start()
    ctx.data["kit_proxy"] = proxy
    ctx.data["kit_db_url"] = (
        make_url(ctx.db_url).set(port=proxy.port).render_as_string(hide_password=False)
    )
    await start_the_kit(ctx)


async def kit_database_refuses(ctx: Ctx) -> None:
    """15b. The consumer kit's database refuses connections and resets the open ones for
    10 s while the kit consumes; then it comes back."""
    first = ctx.data["kits"][0]
    want = ctx.rows // 5
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(kit_handler.counts, ctx.engine))[1] < want:
        if first.poll() is not None or time.monotonic() > deadline:
            raise ScenarioError(f"the consumer kit did not reach {want} effects")
        await asyncio.sleep(0.01)
    proxy: TcpProxy = ctx.data["kit_proxy"]
    await ctx.fault_now("the consumer kit's database refuses connections for 10 s")
    await proxy.refuse()
    await ctx.landed()
    await asyncio.sleep(10)
    await proxy.accept()


async def check_outage_effects(ctx: Ctx) -> None:
    """15b, after: effects once, nothing dead-lettered, one outage logged with its length."""
    await check_effects_once(ctx)
    dead = await _dead_letters(ctx)
    ctx.check(f"no good message dead-lettered ({len(dead)})", not dead)
    logs = _kit_logs(ctx)
    once = logs.count("does not answer") == 1 and logs.count("answers again after") == 1
    ctx.check("one WARNING when the outage began, one INFO with its length when it ended", once)


async def start_the_kit_supervised(ctx: Ctx) -> None:
    """15c, before the rows flow: a poison message that kills the kit's process waits in its
    queue, and the kit runs under a supervisor that starts it again whenever it dies (as
    systemd's Restart=always or a Kubernetes pod would)."""
    async with amqp.channel(ctx.amqp_url) as ch:
        await ch.basic_publish(
            b"poison",
            exchange="",
            routing_key=ctx.names["kit"],
            properties=Basic.Properties(
                message_id="poison-1", headers={"crash": True}, delivery_mode=2
            ),
        )
    await start_the_kit(ctx)
    ctx.data["crashes"] = 0

    async def supervise() -> None:
        while True:
            proc = ctx.data["kits"][-1]
            while proc.poll() is None:
                await asyncio.sleep(0.05)
            if ctx.data.get("stopping"):
                return
            ctx.data["crashes"] += 1
            _spawn_kit(ctx)

    ctx.data["supervisor"] = asyncio.create_task(supervise())


async def poison_waits(ctx: Ctx) -> None:
    """15c. The fault is in the data: the poison is consumed and kills the kit, again and
    again, while the rows flow."""
    await ctx.fault_now("a message that kills the consumer kit's process")
    await ctx.landed()


async def check_poison_dead_lettered(ctx: Ctx) -> None:
    """15c, after: effects once for every confirmed row, the poison alone dead-lettered after
    the delivery limit (limit + 1 crashes: the first delivery, then one per counted attempt)."""
    deadline = time.monotonic() + 60
    dead: list[str] = []
    while not dead and time.monotonic() < deadline:
        dead = await _dead_letters(ctx)
        await asyncio.sleep(0.2)
    await check_effects_once(ctx)
    crashes = ctx.data["crashes"]
    ctx.note(f"kit crashes: {crashes}; dead letters: {dead}")
    ctx.check("the dead-letter queue holds exactly the poison", dead == ["poison-1"])
    ctx.check(
        f"dead-lettered after the limit ({crashes} crashes, limit {KIT_LIMIT})",
        crashes == KIT_LIMIT + 1,
    )


async def stop_the_kits(ctx: Ctx) -> None:
    ctx.data["stopping"] = True
    supervisor = ctx.data.get("supervisor")
    if supervisor is not None:
        supervisor.cancel()
    for proc in ctx.data.get("kits", []):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
    proxy = ctx.data.get("kit_proxy")
    if proxy is not None:
        await proxy.close()


# ---------------------------------------------------------------- 3, 4, 5, 6: broker faults


def armed(action: str) -> Step:
    """A setup step: start the ``rabbitmqctl eval`` that will run ``action`` on :func:`fire`."""

    async def arm(ctx: Ctx) -> None:
        command = ArmedEval(ctx.services, action, workdir=ctx.log_dir / "armed")
        ctx.data["armed"] = command
        await asyncio.to_thread(command.arm)

    return arm


async def fire(ctx: Ctx) -> str:
    command: ArmedEval = ctx.data["armed"]
    command.fire()
    return await asyncio.to_thread(command.result)


async def disarm(ctx: Ctx) -> None:
    command: ArmedEval | None = ctx.data.get("armed")
    if command is not None:
        command.disarm()


async def broker_stop_start(ctx: Ctx) -> None:
    """3a. ``rabbitmqctl stop_app`` mid-drain (armed), ``start_app`` 2 s later."""
    await ctx.fault_now("rabbitmqctl stop_app")
    await fire(ctx)
    await ctx.landed()
    await asyncio.sleep(2)
    await ctx.ctl("start_app")


async def broker_kill(ctx: Ctx) -> None:
    """3b. ``kill -9`` of the broker's VM mid-drain, then a restart."""
    await ctx.fault_now("kill -9 of the broker")
    pid = await asyncio.to_thread(ctx.services.kill_broker)
    ctx.note(f"killed broker pid {pid}")
    await ctx.landed()
    await asyncio.sleep(1)
    began = time.monotonic()
    await asyncio.to_thread(ctx.services.start_rabbitmq)
    ctx.note(f"broker restarted in {time.monotonic() - began:.1f}s")


async def broker_kill_ten_times(ctx: Ctx) -> None:
    """3c. ``kill -9`` of the broker and a restart, ten times in a row under one drain. After
    a restart the broker takes connections before every durable queue's binding is back, and a
    publisher that reconnected at once had every row come back ``312 NO_ROUTE`` and end
    ``returned`` (a clean-clone CI run, issue 44): the return grace retries them."""
    await ctx.fault_now("kill -9 and restart of the broker, ten times in a row")
    for turn in range(10):
        before = (await ctx.counts()).get("confirmed", 0)
        pid = await asyncio.to_thread(ctx.services.kill_broker)
        if turn == 0:
            await ctx.landed()
        await asyncio.sleep(0.5)
        began = time.monotonic()
        await asyncio.to_thread(ctx.services.start_rabbitmq)
        ctx.note(f"kill {turn + 1}: pid {pid}, restarted in {time.monotonic() - began:.1f}s")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the drain moves on before the next kill
            if (await ctx.counts()).get("confirmed", 0) >= before + ctx.rows // 100:
                break
            await asyncio.sleep(0.1)
        else:
            ctx.note(
                f"kill {turn + 1}: fewer than {ctx.rows // 100} rows confirmed in 20s after it"
            )


async def _returns_retried(ctx: Ctx) -> None:
    await _reconnected(ctx)
    logs = "".join(p.log_text() for p in ctx.publishers)
    early = len(re.findall(r"returned 312 NO_ROUTE within [0-9.]+s of connecting", logs))
    ctx.note(f"{early} reconnects saw 312 NO_ROUTE returns within the grace (retried)")
    counts = await ctx.counts()
    ctx.check("the drain went on through every kill", counts.get("confirmed", 0) == ctx.rows)


async def close_all_connections(ctx: Ctx) -> None:
    """4. ``rabbitmqctl close_all_connections`` (the private broker: every client, the verifier
    too)."""
    await ctx.fault_now("rabbitmqctl close_all_connections")
    await fire(ctx)
    await ctx.landed()


async def blackhole(ctx: Ctx) -> None:
    """5. The proxy between publisher and broker swallows everything, sockets stay open."""
    assert ctx.proxy is not None
    seen = len(ctx.proxy.accepted)
    await ctx.fault_now("black-hole of the publisher's connection")
    ctx.proxy.blackhole()
    await ctx.landed()
    start = time.monotonic()
    deadline = start + 60
    while len(ctx.proxy.accepted) <= seen:
        if time.monotonic() > deadline:
            raise ScenarioError("the publisher never reconnected after the black-hole")
        await asyncio.sleep(0.05)
    detected = time.monotonic() - start
    ctx.proxy.heal()
    hb = int(ctx.scenario.env["OUTBOX_HEARTBEAT"])
    timeout = float(ctx.scenario.env["OUTBOX_CONFIRM_TIMEOUT"])
    bound = min(2 * hb + hb / 2, timeout) + 2.0
    ctx.note(
        f"publisher reconnected {detected:.1f}s after the black-hole "
        f"(heartbeat {hb}s, confirm timeout {timeout:.0f}s)"
    )
    ctx.check(f"dead connection detected within {bound:.1f}s", detected <= bound)


async def arm_memory_alarm(ctx: Ctx) -> None:
    original = await asyncio.to_thread(ctx.services.memory_watermark)
    ctx.data["watermark"] = original if re.fullmatch(r"[0-9.]+", original) else "0.4"
    await armed("vm_memory_monitor:set_vm_memory_high_watermark(0.0)")(ctx)


async def memory_alarm(ctx: Ctx) -> None:
    """6. ``set_vm_memory_high_watermark 0`` for 4 s: every publishing connection blocked."""
    await ctx.fault_now("memory alarm (watermark 0) for 4s")
    await fire(ctx)
    await ctx.landed()
    await asyncio.sleep(4)
    await ctx.ctl("set_vm_memory_high_watermark", ctx.data["watermark"])


async def restore_watermark(ctx: Ctx) -> None:
    await disarm(ctx)
    await ctx.ctl("set_vm_memory_high_watermark", ctx.data.get("watermark", "0.4"))


async def blocked_seen(ctx: Ctx) -> None:
    logs = "".join(p.log_text() for p in ctx.publishers)
    ctx.check("connection.blocked seen by the publisher", "broker blocked publishing" in logs)
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    blocked = sum(float(s.get("blocked_seconds", 0)) for s in stats.values())
    ctx.note(f"publisher blocked for {blocked:.1f}s")
    ctx.check("publisher counted its blocked time", blocked > 0)


# ---------------------------------------------------------------- 7, 8, 9, 10: broker says no


def overflow_topology(ctx: Ctx) -> Topology:
    limit = 500
    ctx.data["max_length"] = limit
    return default_topology(ctx, {"x-max-length": limit, "x-overflow": "reject-publish"})


def overflow_plan(ctx: Ctx) -> list[PlannedRow]:
    """A generous retry budget: the queue stays full for a while, each row may be nacked often."""
    return [
        PlannedRow(r.message_id, r.exchange, r.routing_key, r.body, max_attempts=40)
        for r in default_plan(ctx)
    ]


async def queue_full(ctx: Ctx) -> None:
    """7. The queue is at ``x-max-length`` (reject-publish) behind a slow consumer: wait for the
    first real nack (a retried row in the DB)."""
    deadline = time.monotonic() + 60
    while True:
        rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
        nacked = [r for r in rows if r.attempts > 1 and "nack" in (r.last_error or "")]
        if nacked:
            break
        if time.monotonic() > deadline:
            raise ScenarioError("the broker never nacked")
        await asyncio.sleep(0.1)
    await ctx.fault_now(f"queue full at x-max-length {ctx.data['max_length']}, slow consumer")


async def count_nacks(ctx: Ctx) -> None:
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    nacks = sum(int(s.get("nacked", 0)) for s in stats.values())
    retried = sum(int(s.get("retried", 0)) for s in stats.values())
    outages = sum(int(s.get("destination_outages", 0)) for s in stats.values())
    ctx.note(
        f"{nacks} nacks received, {retried} retries with backoff, {outages} destination "
        f"outages (bursts of nacks: rows waited, no budget spent)"
    )
    ctx.check("the broker nacked publishes", nacks > 0)


def two_keys_topology(ctx: Ctx) -> Topology:
    ex, q = ctx.names["exchange"], ctx.names["queue"]
    return Topology(exchanges=[ex], queues={q: {}}, bindings=[(ex, q, "rk"), (ex, q, "rk.audit")])


def audit_plan(ctx: Ctx) -> list[PlannedRow]:
    """Every 20th row goes to ``rk.audit``: routed until the binding goes, then returned."""
    may_return = Expect(status="returned", needle="312", or_confirmed=True)
    return [
        PlannedRow(r.message_id, r.exchange, "rk.audit", r.body, expect=may_return)
        if i % 20 == 0
        else r
        for i, r in enumerate(default_plan(ctx))
    ]


async def unbind(ctx: Ctx) -> None:
    """8. The binding of ``rk.audit`` is removed mid-flow: mandatory publishes come back (312)."""
    await ctx.fault_now("queue.unbind of rk.audit (its rows become unroutable)")
    await amqp.unbind(
        ctx.amqp_url, queue=ctx.names["queue"], exchange=ctx.names["exchange"], key="rk.audit"
    )
    await ctx.landed()


async def count_returned(ctx: Ctx) -> None:
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    returned = [r for r in rows if r.status == "returned"]
    ctx.check(
        f"unroutable rows ended returned with 312 ({len(returned)})",
        bool(returned) and all(r.reply_code == 312 for r in returned),
    )


def second_exchange_topology(ctx: Ctx) -> Topology:
    ex, q = ctx.names["exchange"], ctx.names["queue"]
    ctx.names["doomed"] = f"{ex}.doomed"
    return Topology(
        exchanges=[ex, ctx.names["doomed"]],
        queues={q: {}},
        bindings=[(ex, q, "rk"), (ctx.names["doomed"], q, "rk")],
    )


def doomed_plan(ctx: Ctx) -> list[PlannedRow]:
    """Every 10th row goes to the exchange that will be deleted."""
    gone = Expect(status="failed", needle="NOT_FOUND", or_confirmed=True)
    return [
        PlannedRow(r.message_id, ctx.names["doomed"], r.routing_key, r.body, expect=gone)
        if i % 10 == 0
        else r
        for i, r in enumerate(default_plan(ctx))
    ]


async def delete_exchange(ctx: Ctx) -> None:
    """9. One of two exchanges is deleted mid-flow: its rows fail (404) after their budget."""
    await ctx.fault_now("exchange.delete of one of the two exchanges (404 for its rows)")
    await amqp.delete_exchange(ctx.amqp_url, ctx.names["doomed"])
    await ctx.landed()


async def count_failed(ctx: Ctx) -> None:
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    failed = [r for r in rows if r.status == "failed"]
    ctx.check(
        f"rows of the deleted exchange ended failed with the reason ({len(failed)})", bool(failed)
    )


MAX_SIZE = 4096


async def lower_max_size(ctx: Ctx) -> None:
    """10, before the publisher connects (channels read the limit when they open)."""
    ctx.data["max_size"] = await asyncio.to_thread(ctx.services.read_env, "max_message_size")
    await ctx.ctl("eval", f"application:set_env(rabbit, max_message_size, {MAX_SIZE}).")


async def restore_max_size(ctx: Ctx) -> None:
    match = re.search(r"\{ok,\s*(\d+)\}", ctx.data.get("max_size", ""))
    value = match.group(1) if match else "134217728"
    await ctx.ctl("eval", f"application:set_env(rabbit, max_message_size, {value}).")


def oversized_plan(ctx: Ctx) -> list[PlannedRow]:
    """Every 100th row of the second two thirds carries an 8 KiB body (over the 4 KiB max)."""
    big = Expect(status="failed", needle="body larger than")
    start = ctx.rows // 3
    return [
        PlannedRow(
            r.message_id, r.exchange, r.routing_key, ob.body_for(i, 2 * MAX_SIZE), expect=big
        )
        if i >= start and i % 100 == 0
        else r
        for i, r in enumerate(default_plan(ctx))
    ]


async def oversized_arrive(ctx: Ctx) -> None:
    await ctx.fault_now(f"bodies over the lowered max_message_size ({MAX_SIZE} B) start flowing")


# ---------------------------------------------------------------- 11: the database


async def terminate_sessions(ctx: Ctx) -> None:
    """11a. ``pg_terminate_backend`` on every session of the publisher's database."""
    await ctx.fault_now("pg_terminate_backend of the publisher's sessions")
    killed = await asyncio.to_thread(ctx.env.dbs.terminate, ctx.db_name)
    await ctx.landed()
    ctx.note(f"{killed} sessions terminated")
    ctx.check("publisher sessions were terminated", killed > 0)


async def restart_postgres(ctx: Ctx) -> None:
    """11b. PostgreSQL stopped (fast shutdown) and started again mid-drain."""
    await ctx.fault_now("PostgreSQL restart")
    began = time.monotonic()
    await asyncio.to_thread(ctx.services.restart_postgres)
    await ctx.landed()
    ctx.note(f"PostgreSQL down and up again in {time.monotonic() - began:.1f}s")


async def crash_postgres(ctx: Ctx) -> None:
    """11d. Every PostgreSQL process killed at once (``kill -9``) mid-drain, then started: crash
    recovery replays the WAL on disk, and the publisher's last write-backs (committed without
    waiting for the disk) may be undone."""
    await ctx.fault_now("PostgreSQL crash (kill -9 of every process)")
    began = time.monotonic()
    await asyncio.to_thread(ctx.services.crash_postgres)
    await ctx.landed()
    ctx.note(f"PostgreSQL crashed and recovered in {time.monotonic() - began:.1f}s")


async def undone_seen(ctx: Ctx) -> None:
    """11d: what the crash undid, from the publisher's own log."""
    await db_errors_seen(ctx)
    logs = "".join(p.log_text() for p in ctx.publishers)
    undone = sum(int(n) for n in re.findall(r"(\d+) rows we had settled are in flight again", logs))
    rewritten = sum(int(n) for n in re.findall(r"(\d+) rows we had confirmed were set back", logs))
    ctx.note(
        f"the crash undid write-backs: {rewritten} confirms written again (not republished), "
        f"{undone} settled rows released as possible duplicates"
    )


async def lose_commit_reply(ctx: Ctx) -> None:
    """11c. The connection to PostgreSQL breaks right after a claim's COMMIT reached the server:
    the rows are claimed (in_flight, leased to this publisher) but the publisher never got them."""
    assert ctx.lost_commit is not None
    await ctx.fault_now("PostgreSQL connection reset right after a claim's COMMIT")
    ctx.lost_commit.arm()
    deadline = time.monotonic() + 20
    while not ctx.lost_commit.fired:
        if time.monotonic() > deadline:
            raise ScenarioError("no claim COMMIT went through the proxy")
        await asyncio.sleep(0.01)
    await ctx.landed()


async def orphans_seen(ctx: Ctx) -> None:
    """11c: the claim whose reply was lost did lease rows (they had to be claimed again)."""
    await db_errors_seen(ctx)
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    again = sum(1 for r in rows if r.attempts > 1)
    ctx.note(f"{again} rows were claimed more than once")
    # settling by ranges a claim writes no row: the orphan check's release shows in the
    # publisher's report instead (rows of ranges leased to it unseen, handed back)
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    released = sum(int(s.get("released", 0)) for s in stats.values())
    ctx.note(f"{released} rows released by the publishers' orphan checks and stops")
    ctx.check("the lost COMMIT reply left leased rows behind", again > 0 or released > 0)


async def db_errors_seen(ctx: Ctx) -> None:
    """The publisher logs each database outage once: a WARNING when a call first fails, an
    INFO with its length when one succeeds again (no line, nor traceback, per failed call)."""
    logs = "".join(p.log_text() for p in ctx.publishers)
    began = len(re.findall(r"a database call failed", logs))
    ended = re.findall(r"the database answers again after ([0-9.]+)s \((\d+) calls", logs)
    ctx.note(f"publisher logged {began} database outage(s) (ended: {ended}) and went on")
    per_call = len(re.findall(r"(claim failed|outcomes failed|housekeeping failed)", logs))
    once = len(ended) == began and per_call == 0
    ctx.check(
        f"each outage logged once, its end with its length ({per_call} lines per failed call)", once
    )


# ---------------------------------------------------------------- 13: Spark


async def spark_driver_kill(ctx: Ctx) -> None:
    """13. The kill happens inside :func:`chaos.spark.produce_with_spark`; nothing more here."""
    if ctx.fault_mono is None:
        raise ScenarioError("the Spark driver was never killed mid-batch")


# ---------------------------------------------------------------- the matrix

KILL_ENV = _env(lease_seconds=LEASE)

# ---------------------------------------------------------------- 17: the three-node cluster

CLUSTER_ENV = _env(heartbeat=2, confirm_timeout=5)
#: 17c: how long two of the three nodes stay down
MAJORITY_DOWN = 60.0


async def _publisher_node(ctx: Ctx, name: str, *, timeout: float = 20.0) -> int:
    """The cluster node a publisher is connected to, from its own report (heartbeat: 1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
        node = stats.get(name, {}).get("broker_node")
        if node:
            return ctx.cluster.node_of_port(int(str(node).rsplit(":", 1)[1]))
        if time.monotonic() > deadline:
            raise ScenarioError(f"publisher {name} reported no broker node in {timeout:.0f}s")
        await asyncio.sleep(0.2)


async def publishers_on_nodes_1_2(ctx: Ctx) -> None:
    """17a: the publisher's URL names nodes 1 and 2; the verifier reads from node 3."""
    ctx.publishers_url = ctx.cluster.url_of((1, 2))


async def kill_the_publishers_node(ctx: Ctx) -> None:
    """17a. kill -9 of the node the publisher is connected to."""
    name = ctx.publishers[0].name
    node = await _publisher_node(ctx, name)
    ctx.data["killed_node"] = node
    await ctx.fault_now(f"kill -9 of node {node}, the publisher's")
    await asyncio.to_thread(ctx.cluster.kill, node)
    await ctx.landed()


async def moved_off_the_killed_node(ctx: Ctx) -> None:
    await _reconnected(ctx)
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    node = stats.get(ctx.publishers[0].name, {}).get("broker_node")
    killed = ctx.data.get("killed_node")
    moved = node is not None and not str(node).endswith(f":{ctx.cluster.port(killed)}")
    ctx.check(f"the publisher moved off node {killed} (now on {node})", moved)


async def verifier_off_the_leader(ctx: Ctx) -> None:
    """17b: find the queue's leader; the verifier reads from another node."""
    leader = await asyncio.to_thread(ctx.cluster.leader, ctx.names["queue"])
    ctx.data["leader"] = leader
    ctx.verifier_url = ctx.cluster.node_url(3 if leader != 3 else 1)


async def kill_the_leader(ctx: Ctx) -> None:
    """17b. kill -9 of the quorum queue's leader node."""
    leader = ctx.data["leader"]
    await ctx.fault_now(f"kill -9 of node {leader}, the quorum queue's leader")
    await asyncio.to_thread(ctx.cluster.kill, leader)
    await ctx.landed()


async def a_new_leader(ctx: Ctx) -> None:
    old = ctx.data.get("leader")
    try:
        now = await asyncio.to_thread(ctx.cluster.leader, ctx.names["queue"])
    except Exception:
        now = None
    ctx.note(f"leader: node {old} killed, node {now} leads now")
    ctx.check("another node leads the queue after the kill", now is not None and now != old)


async def stop_a_majority(ctx: Ctx) -> None:
    """17c. Nodes 1 and 2 stopped (a quorum queue without a majority), started after a minute."""
    await ctx.fault_now(f"nodes 1 and 2 stopped for {MAJORITY_DOWN:.0f}s")
    await asyncio.gather(
        asyncio.to_thread(ctx.cluster.stop_node, 1), asyncio.to_thread(ctx.cluster.stop_node, 2)
    )
    await ctx.landed()
    before = await ctx.counts()
    await asyncio.sleep(MAJORITY_DOWN)
    after = await ctx.counts()
    ctx.note(
        f"confirmed {before.get('confirmed', 0)} -> {after.get('confirmed', 0)} while the "
        f"majority was down"
    )
    ctx.check("no row ended nacked while the majority was down", not after.get("nacked", 0))
    await asyncio.to_thread(ctx.cluster.start)


async def rows_waited_without_spending(ctx: Ctx) -> None:
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    nacks = sum(r.nacks for r in rows)
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    outages = sum(int(s.get("destination_outages", 0)) for s in stats.values())
    timeouts = sum(int(s.get("confirm_timeouts", 0)) for s in stats.values())
    nacked = sum(int(s.get("nacked", 0)) for s in stats.values())
    ctx.note(
        f"broker nacks {nacked}, nack budget spent {nacks} (rows' nacks), destination "
        f"outages {outages}, confirm timeouts {timeouts}, most attempts of a row "
        f"{max((r.attempts for r in rows), default=0)}"
    )
    ctx.check("no row spent its nack budget (nacks 0 on every row)", nacks == 0)
    ctx.check(
        "the outage was seen (a destination outage or a confirm timeout counted)",
        outages + timeouts >= 1,
    )


#: 17d: how long the publisher's node stays frozen
FREEZE = 30.0


async def freeze_the_publishers_node(ctx: Ctx) -> None:
    """17d. SIGSTOP of the node the publisher is connected to for FREEZE s, then SIGCONT: its
    sockets stay open and say nothing, so only the heartbeat or the confirm timeout can tell."""
    name = ctx.publishers[0].name
    node = await _publisher_node(ctx, name)
    ctx.data["frozen_node"] = node
    await ctx.fault_now(f"SIGSTOP of node {node}, the publisher's, for {FREEZE:.0f}s")
    began = time.monotonic()
    await asyncio.to_thread(ctx.cluster.freeze, node)
    try:
        await ctx.landed()
        moved = await _moved_off(ctx, name, node, timeout=FREEZE - 2)
        after = time.monotonic() - began
        ctx.note(
            f"publisher moved off the frozen node {node} to node {moved} after {after:.1f}s"
            if moved
            else f"publisher still on the frozen node {node} after {after:.0f}s"
        )
        hb = int(ctx.scenario.env["OUTBOX_HEARTBEAT"])
        timeout = float(ctx.scenario.env["OUTBOX_CONFIRM_TIMEOUT"])
        bound = min(2 * hb + hb / 2, timeout) + 3.0  # + the stats report's second and a connect
        ctx.check(
            f"the publisher moved off the frozen node within {bound:.1f}s",
            moved is not None and after <= bound,
        )
        await asyncio.sleep(max(0.0, FREEZE - (time.monotonic() - began)))
    finally:
        await asyncio.to_thread(ctx.cluster.thaw, node)


async def _moved_off(ctx: Ctx, name: str, node: int, *, timeout: float) -> int | None:
    """Wait until the publisher reports a node other than ``node``; that node, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
        now = stats.get(name, {}).get("broker_node")
        if now and not str(now).endswith(f":{ctx.cluster.port(node)}"):
            return ctx.cluster.node_of_port(int(str(now).rsplit(":", 1)[1]))
        await asyncio.sleep(0.2)
    return None


async def thaw_everything(ctx: Ctx) -> None:
    """17d teardown: a node left frozen by a failed run cannot be stopped or restarted."""
    node = ctx.data.get("frozen_node")
    if node is not None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ctx.cluster.thaw, node)


async def rolling_restart(ctx: Ctx) -> None:
    """17e. Every node in turn stopped gracefully, started again, and waited for until the
    cluster sees three running nodes, while rows flow into the quorum queue (the verifier
    reconnects to its node when that one's turn comes)."""
    await ctx.fault_now("rolling restart of nodes 1, 2, 3")
    for node in (1, 2, 3):
        began = time.monotonic()
        await asyncio.to_thread(ctx.cluster.stop_node, node)
        await ctx.landed()
        stopped = time.monotonic() - began
        await asyncio.to_thread(ctx.cluster.start_node, node)
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(ctx.cluster.running_nodes, node) < 3:
            if time.monotonic() > deadline:
                raise ScenarioError(f"node {node} did not rejoin within 60s")
            await asyncio.sleep(0.5)
        counts = await ctx.counts()
        ctx.note(
            f"node {node}: stopped in {stopped:.1f}s, back in the cluster "
            f"{time.monotonic() - began:.1f}s after its stop began; "
            f"{counts.get('confirmed', 0)} rows confirmed by then"
        )


async def rows_flowed_through_the_restart(ctx: Ctx) -> None:
    """17e, after: the publisher reconnected, and no row spent its nack budget (a majority
    was up throughout: nothing for the broker to refuse)."""
    await _reconnected(ctx)
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    total = {
        k: sum(int(s.get(k, 0)) for s in stats.values())
        for k in ("nacked", "destination_outages", "confirm_timeouts", "reconnects")
    }
    ctx.note(
        f"publisher counters: {total}; most attempts of a row "
        f"{max((r.attempts for r in rows), default=0)}"
    )
    ctx.check("no row spent its nack budget (nacks 0 on every row)", not any(r.nacks for r in rows))


async def publishers_on_the_leader(ctx: Ctx) -> None:
    """17f: the verifier off the leader; the publishers' URL names the leader and the third node
    (each publisher starts on the leader half the time: the hosts are shuffled)."""
    await verifier_off_the_leader(ctx)
    leader = ctx.data["leader"]
    verifier = ctx.cluster.node_of_port(int(str(ctx.verifier_url).rsplit(":", 1)[1].rstrip("/")))
    other = next(n for n in (1, 2, 3) if n not in (leader, verifier))
    ctx.publishers_url = ctx.cluster.url_of((leader, other))


async def kill_the_leader_under_publishers(ctx: Ctx) -> None:
    """17f. kill -9 of the leader; which publishers it cut off is noted."""
    leader = ctx.data["leader"]
    on = [p.name for p in ctx.publishers if await _publisher_node(ctx, p.name) == leader]
    ctx.note(f"{len(on)} of {len(ctx.publishers)} publishers connected to the leader at the kill")
    await kill_the_leader(ctx)


async def ordered_through_the_leader_change(ctx: Ctx) -> None:
    await a_new_leader(ctx)
    await check_key_order(ctx)


async def verifier_off_the_kit_leader(ctx: Ctx) -> None:
    """17g, before the rows flow: the verifier and the consumer kit on a node that does not lead
    the kit's quorum queue; the kit starts consuming."""
    leader = await asyncio.to_thread(ctx.cluster.leader, ctx.names["kit"])
    ctx.data["leader"] = leader
    ctx.verifier_url = ctx.cluster.node_url(3 if leader != 3 else 1)
    await start_the_kit(ctx)


async def kill_the_kit_leader(ctx: Ctx) -> None:
    """17g. kill -9 of the kit's quorum queue's leader while the kit consumes from it (a fifth
    of the messages had their effect)."""
    first = ctx.data["kits"][0]
    want = ctx.rows // 5
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(kit_handler.counts, ctx.engine))[1] < want:
        if first.poll() is not None or time.monotonic() > deadline:
            raise ScenarioError(f"the consumer kit did not reach {want} effects")
        await asyncio.sleep(0.01)
    leader = ctx.data["leader"]
    await ctx.fault_now(f"kill -9 of node {leader}, the kit's quorum queue's leader")
    await asyncio.to_thread(ctx.cluster.kill, leader)
    await ctx.landed()


async def kit_effects_through_the_leader_change(ctx: Ctx) -> None:
    old = ctx.data.get("leader")
    try:
        now = await asyncio.to_thread(ctx.cluster.leader, ctx.names["kit"])
    except Exception:
        now = None
    ctx.note(f"kit queue's leader: node {old} killed, node {now} leads now")
    ctx.check("another node leads the kit's queue after the kill", now is not None and now != old)
    ctx.check("the consumer kit kept running", ctx.data["kits"][0].poll() is None)
    await check_effects_once(ctx)


def quorum_kit_topology(ctx: Ctx) -> Topology:
    """:func:`kit_topology` with both queues quorum queues (the kit's with a delivery limit)."""
    topo = kit_topology(ctx)
    topo.queues[ctx.names["queue"]] = {"x-queue-type": "quorum"}
    topo.queues[ctx.names["kit"]] = {"x-queue-type": "quorum", "x-delivery-limit": 100}
    return topo


# ---------------------------------------------------------------- faults that last (chaos-long)

#: 17c-long: how long two of the three nodes stay down (the quorum queue leaderless)
LONG_OUTAGE = float(os.environ.get("CHAOS_LONG_OUTAGE", "600"))


async def stop_a_majority_long(ctx: Ctx) -> None:
    """17c-long. Nodes 1 and 2 stopped for LONG_OUTAGE s (10 min): the quorum queue has no
    leader for that long while the publisher keeps trying; then both started again."""
    await ctx.fault_now(f"nodes 1 and 2 stopped for {LONG_OUTAGE:.0f}s")
    await asyncio.gather(
        asyncio.to_thread(ctx.cluster.stop_node, 1), asyncio.to_thread(ctx.cluster.stop_node, 2)
    )
    await ctx.landed()
    before = await ctx.counts()
    began = time.monotonic()
    worst: dict[str, int] = {}
    while time.monotonic() - began < LONG_OUTAGE:
        await asyncio.sleep(min(30.0, LONG_OUTAGE - (time.monotonic() - began)))
        counts = await ctx.counts()
        for state in ("nacked", "failed"):
            worst[state] = max(worst.get(state, 0), counts.get(state, 0))
    after = await ctx.counts()
    ctx.note(
        f"confirmed {before.get('confirmed', 0)} -> {after.get('confirmed', 0)} during the "
        f"{LONG_OUTAGE:.0f}s outage; pending {after.get('pending', 0)}, in flight "
        f"{after.get('in_flight', 0)} at its end"
    )
    ctx.check(f"no row ended nacked or failed during the outage ({worst})", not any(worst.values()))
    restarted = time.monotonic()
    await asyncio.to_thread(ctx.cluster.start)
    ctx.note(f"nodes 1 and 2 started again in {time.monotonic() - restarted:.1f}s")


async def long_outage_accounted(ctx: Ctx) -> None:
    """17c-long, after: no nack budget spent, the outage counted and logged (not per attempt)."""
    await rows_waited_without_spending(ctx)
    logs = "".join(p.log_text() for p in ctx.publishers)
    lines = len(logs.splitlines())
    out = len(re.findall(r"is out \(", logs))
    back = re.findall(r"takes publishes again: its outage lasted ([0-9.]+)s", logs)
    timeouts = len(re.findall(r"no confirm for [0-9.]+s: dropping the connection", logs))
    ctx.note(
        f"publisher log: {lines} lines; {out} outage(s) begun, ended after {back} s; "
        f"{timeouts} confirm-timeout lines"
    )


# ---------------------------------------------------------------- 18: the single broker and
# PostgreSQL out for minutes, under a steady producer (chaos-long)

#: 18c: how long the disk alarm is held
DISK_ALARM = float(os.environ.get("CHAOS_DISK_ALARM", "180"))
#: rows a second the steady producer commits (in transactions of 10)
PRODUCER_RATE = 50.0
#: seconds over which the batch becomes due (as 17c's: the fault lands while it drains)
LONG_FLOW = 20.0
#: seconds the producer goes on once the outage's backlog is confirmed
AFTERGLOW = 5.0
CATCH_UP_TIMEOUT = 300.0
#: a record of the publisher's log starts with its time (a traceback's lines do not)
RECORD = re.compile(r"^\d{4}-\d\d-\d\dT", re.MULTILINE)


async def start_producing(ctx: Ctx) -> None:
    """18a-c: the batch (``--rows``, due over the scenario's flow: the fault lands while it
    drains) and, on top, an application committing PRODUCER_RATE rows a second through
    ``enqueue`` (its failed commits retried with the same rows) from now until the outage's
    backlog is drained."""
    await insert_batch(ctx)
    producer = SteadyProducer(
        db_url=ctx.db_url,
        exchange=ctx.names["exchange"],
        routing_key="rk",
        prefix=ctx.run,
        rate=PRODUCER_RATE,
    )
    ctx.data["producer"] = producer.start()


async def stop_producing(ctx: Ctx) -> None:
    producer: SteadyProducer | None = ctx.data.get("producer")
    if producer is not None:
        await asyncio.to_thread(producer.stop)


def _log_marks(ctx: Ctx) -> list[int]:
    return [len(p.log_text()) for p in ctx.publishers]


def _log_since(ctx: Ctx, marks: list[int]) -> str:
    return "".join(p.log_text()[at:] for p, at in zip(ctx.publishers, marks, strict=True))


async def _stats(ctx: Ctx) -> dict[str, Any]:
    stats = await asyncio.to_thread(ob.publisher_stats, ctx.engine)
    return next(iter(stats.values()), {})


async def _hold(
    ctx: Ctx,
    *,
    what: str,
    seconds: float,
    begin: Callable[[], object],
    end: Callable[[], object],
    db_down: bool = False,
) -> str:
    """Inject ``begin``, hold it ``seconds`` while the producer goes on, ``end`` it; then wait
    until every row committed before the end is confirmed (the catch-up), stop the producer and
    expect each row it committed. Returns the publishers' log from the fault to the catch-up."""
    producer: SteadyProducer = ctx.data["producer"]
    batch = ctx.rows
    ctx.rows = batch + producer.count
    marks = _log_marks(ctx)
    await ctx.fault_now(f"{what} for {seconds:.0f}s")
    counts = await ctx.counts()
    open_at = sum(counts.get(state, 0) for state in OPEN)
    before, began = producer.count, time.monotonic()
    await asyncio.to_thread(begin)
    ctx.note(f"fault in effect {time.monotonic() - began:.1f}s after the command")
    if not db_down:  # else the rows open at the fault, read just before it
        counts = await ctx.counts()
        open_at = sum(counts.get(state, 0) for state in OPEN)
    ctx.data["landed"] = True
    ctx.check(f"the fault landed mid-flow ({open_at} rows pending or in flight)", open_at > 0)
    worst: dict[str, int] = {}
    while (left := seconds - (time.monotonic() - began)) > 0:
        await asyncio.sleep(min(30.0, left))
        if not db_down:  # the runner's reads would fail with PostgreSQL down
            counts = await ctx.counts()
            for state in ("nacked", "failed", "returned"):
                worst[state] = max(worst.get(state, 0), counts.get(state, 0))
            ctx.data.setdefault("open_during", []).append(sum(counts.get(s, 0) for s in OPEN))
    if not db_down:
        ctx.data["stats_at_end"] = await _stats(ctx)
        ctx.check(
            f"no row ended nacked, failed or returned during the fault ({worst})",
            not any(worst.values()),
        )
    ended = time.monotonic()
    await asyncio.to_thread(end)
    ctx.note(
        f"fault held {ended - began:.0f}s, ended in {time.monotonic() - ended:.1f}s; the "
        f"producer committed {producer.count - before} rows meanwhile "
        f"({producer.failed_commits} failed commits, longest failing "
        f"{producer.longest_failing:.0f}s)"
    )
    ctx.data["fault_seconds"] = ended - began
    mark = await asyncio.to_thread(ob.last_id, ctx.engine)
    while (left_open := await asyncio.to_thread(ob.open_up_to, ctx.engine, mark)) > 0:
        if time.monotonic() - ended > CATCH_UP_TIMEOUT:
            ctx.note(f"catch-up not done {CATCH_UP_TIMEOUT:.0f}s after the fault: {left_open} open")
            break
        await asyncio.sleep(0.2)
    else:
        catch_up = time.monotonic() - ended
        ctx.data["catch_up"] = catch_up
        ctx.note(
            f"catch-up: every row committed by the fault's end (id <= {mark}) confirmed "
            f"{catch_up:.1f}s after the command ending it was issued"
        )
    logs = _log_since(ctx, marks)
    await asyncio.sleep(AFTERGLOW)
    committed = await asyncio.to_thread(producer.stop)
    ctx.expect.update(dict.fromkeys(committed, ob.CONFIRMED))
    ctx.rows = ctx.result.rows = len(ctx.expect)
    ctx.note(f"rows: {batch} of the batch, {len(committed)} from the steady producer")
    records = len(RECORD.findall(logs))
    ctx.note(
        f"publisher log from the fault to the catch-up: {records} records "
        f"({len(logs.splitlines())} lines)"
    )
    ctx.data["log_records"] = records
    return logs


def _bounded_log(ctx: Ctx, seconds: float) -> None:
    """At most a dozen records plus two a minute, however many attempts failed."""
    bound = 12 + 2 * int(seconds // 60)
    records = ctx.data.get("log_records", 0)
    ctx.check(
        f"publisher log bounded during the fault ({records} records <= {bound})", records <= bound
    )


async def broker_down_long(ctx: Ctx) -> None:
    """18a. The single broker stopped (``rabbitmqctl stop``) for LONG_OUTAGE s, then started."""
    logs = await _hold(
        ctx,
        what="broker stopped",
        seconds=LONG_OUTAGE,
        begin=ctx.services.stop_rabbitmq,
        end=ctx.services.start_rabbitmq,
    )
    stats = ctx.data.get("stats_at_end", {})
    gauge = float(stats.get("broker_unreachable_seconds") or 0)
    ctx.note(
        f"publisher report at the outage's end: connected {stats.get('connected')}, "
        f"broker_unreachable_seconds {gauge:.0f}, connect_failures {stats.get('connect_failures')}"
    )
    ctx.check(
        "the report showed the broker unreachable for most of the outage",
        stats.get("connected") is False and gauge >= 0.9 * LONG_OUTAGE - 5,
    )
    began = len(re.findall(r"cannot connect to the broker at", logs))
    reminders = len(re.findall(r"broker still unreachable after", logs))
    per_attempt = len(re.findall(r"next connection attempt in", logs))
    back = re.findall(
        r"the broker answers again after ([0-9.]+)s \((\d+) connection attempts", logs
    )
    ctx.note(
        f"publisher logged the outage's start {began}x, {reminders} reminders, "
        f"{per_attempt} lines per attempt, its end: {back}"
    )
    ctx.check("the outage's start logged once, no line per attempt", began == 1 and not per_attempt)
    ctx.check(
        "its end logged once with its length",
        len(back) == 1 and float(back[0][0]) >= 0.95 * LONG_OUTAGE,
    )
    _bounded_log(ctx, LONG_OUTAGE)


async def postgres_down_long(ctx: Ctx) -> None:
    """18b. The outbox's PostgreSQL stopped (fast shutdown) for LONG_OUTAGE s, then started."""
    logs = await _hold(
        ctx,
        what="PostgreSQL stopped",
        seconds=LONG_OUTAGE,
        begin=ctx.services.stop_postgres,
        end=ctx.services.start_postgres,
        db_down=True,
    )
    producer: SteadyProducer = ctx.data["producer"]
    ctx.check(
        f"the producer's commits failed through the outage ({producer.failed_commits} failed, "
        f"longest {producer.longest_failing:.0f}s)",
        producer.longest_failing >= 0.9 * LONG_OUTAGE,
    )
    began = len(re.findall(r"a database call failed", logs))
    back = re.findall(r"the database answers again after ([0-9.]+)s \((\d+) calls", logs)
    listen = re.findall(r"LISTEN \S+ on \S+ failed", logs)
    ctx.note(
        f"publisher logged the outage's start {began}x, its end: {back}; the listener's "
        f"failures {len(listen)}x"
    )
    ctx.check("the database outage's start logged once", began == 1)
    ctx.check(
        "its end logged once with its length",
        len(back) == 1 and float(back[0][0]) >= 0.95 * LONG_OUTAGE,
    )
    _bounded_log(ctx, LONG_OUTAGE)


async def disk_alarm_long(ctx: Ctx) -> None:
    """18c. The broker's disk free limit set above the free disk (a disk alarm: publishers
    blocked) for DISK_ALARM s, then set back."""
    original = (await ctx.ctl("eval", "rabbit_disk_monitor:get_disk_free_limit().")).strip()
    ctx.data["disk_limit"] = original
    free = shutil.disk_usage(ctx.services.local_dir).free
    above = str(free + 100 * 2**30)
    ctx.note(f"disk free limit {original} bytes, free {free} bytes; alarm at {above}")
    confirmed = (await ctx.counts()).get("confirmed", 0)
    logs = await _hold(
        ctx,
        what=f"disk alarm (disk_free_limit {above})",
        seconds=DISK_ALARM,
        begin=lambda: ctx.services.ctl("set_disk_free_limit", above),
        end=lambda: ctx.services.ctl("set_disk_free_limit", original),
    )
    stats = ctx.data.get("stats_at_end", {})
    ctx.note(
        f"confirmed {confirmed} at the alarm; publisher report at its end: blocked "
        f"{stats.get('blocked')} ({stats.get('blocked_reason')}), confirmed "
        f"{stats.get('confirmed')}"
    )
    ctx.check(
        "the report showed the publisher blocked at the alarm's end", bool(stats.get("blocked"))
    )
    blocked = len(re.findall(r"broker blocked publishing", logs))
    unblocked = len(re.findall(r"broker unblocked publishing", logs))
    ctx.check(
        f"blocked once, unblocked once in the log ({blocked}, {unblocked})",
        blocked == unblocked == 1,
    )
    _bounded_log(ctx, DISK_ALARM)


async def reset_disk_limit(ctx: Ctx) -> None:
    await stop_producing(ctx)
    original = ctx.data.get("disk_limit")
    if original:
        await ctx.ctl("set_disk_free_limit", original)


async def broker_started(ctx: Ctx) -> None:
    await stop_producing(ctx)
    await asyncio.to_thread(ctx.services.start_rabbitmq)


async def postgres_started(ctx: Ctx) -> None:
    await stop_producing(ctx)
    await asyncio.to_thread(ctx.services.start_postgres)


async def long_fault_accounted(ctx: Ctx) -> None:
    """18a-c, after: what the fault cost the rows (nack budget, attempts) and the product."""
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    stats = await _stats(ctx)
    nacks = sum(r.nacks for r in rows)
    shown = [
        "nacked",
        "destination_outages",
        "confirm_timeouts",
        "lost_confirms",
        "reconnects",
        "connect_failures",
        "db_errors",
        "lease_lost",
        "released",
    ]
    ctx.note(
        f"nack budget spent {nacks}; publisher counters "
        + ", ".join(f"{name} {stats.get(name, 0)}" for name in shown)
        + f", blocked_seconds {float(stats.get('blocked_seconds', 0)):.1f}; most attempts of a row "
        f"{max((r.attempts for r in rows), default=0)}, rows claimed more than once "
        f"{sum(1 for r in rows if r.attempts > 1)}"
    )
    ctx.check("no row spent its nack budget (nacks 0 on every row)", nacks == 0)
    if ctx.scenario.key == "18c":
        blocked = float(stats.get("blocked_seconds", 0))
        ctx.check(
            f"the publisher counted its blocked time ({blocked:.0f}s of {DISK_ALARM:.0f}s)",
            blocked >= 0.9 * DISK_ALARM,
        )
        ctx.check("no confirm timeout while blocked", not stats.get("confirm_timeouts"))


SCENARIOS: list[Scenario] = [
    Scenario(
        "1",
        "kill -9 publisher after publish, before confirms are marked",
        "acked publishes whose confirm never reached the DB are published again, and only "
        "those: duplicates <= rows in flight at the kill, all counted in lost_confirms",
        kill_after_publish,
        trigger=0.2,
        flow=0,
        env={**KILL_ENV, **_env(flush_interval=0.5)},
    ),
    Scenario(
        "2",
        "kill -9 publisher after claim, before publish",
        "claimed rows that never left come back when their lease expires (not sooner), "
        "then go out once",
        kill_after_claim,
        env=KILL_ENV,
        via_proxy=True,
        verify=check_lease_wait,
    ),
    Scenario(
        "3a",
        "broker stop_app / start_app mid-drain",
        "a broker that goes away and comes back: reconnect, republish the unconfirmed",
        broker_stop_start,
        flow=1.5,
        setup=armed("rabbit:stop()"),
        teardown=disarm,
        verify=_reconnected,
    ),
    Scenario(
        "3b",
        "broker kill -9 and restart mid-drain",
        "confirmed means on disk: nothing confirmed is lost with the broker's VM",
        broker_kill,
        flow=1.5,
        verify=_reconnected,
    ),
    Scenario(
        "3c",
        "broker kill -9 and restart, ten times in a row, under one drain",
        "a binding not yet recovered after a restart is not unroutable: no row ends returned",
        broker_kill_ten_times,
        flow=120.0,
        trigger=0.05,
        verify=_returns_retried,
        timeout=420.0,
    ),
    Scenario(
        "4",
        "rabbitmqctl close_all_connections mid-drain",
        "connection.close from the broker: unconfirmed rows go out again on a new connection",
        close_all_connections,
        flow=1.5,
        setup=armed('rabbit_networking:close_all_connections("chaos: close_all_connections")'),
        teardown=disarm,
        verify=_reconnected,
    ),
    Scenario(
        "5",
        "TCP black-hole between publisher and broker",
        "a silent network partition is detected by heartbeat or confirm timeout, and healed",
        blackhole,
        flow=1.5,
        via_proxy=True,
        env=_env(heartbeat=2, confirm_timeout=5),
    ),
    Scenario(
        "6",
        "memory alarm (vm_memory_high_watermark 0) for 4 s",
        "connection.blocked pauses publishing without failing a row; the drain resumes",
        memory_alarm,
        setup=arm_memory_alarm,
        flow=1.5,
        verify=blocked_seen,
        teardown=restore_watermark,
    ),
    Scenario(
        "7",
        "queue at x-max-length (reject-publish), slow consumer",
        "real nacks are retried with backoff (or, in bursts, pause the exchange) until every "
        "row is confirmed",
        queue_full,
        flow=0,
        topology=overflow_topology,
        plan=overflow_plan,
        verifier_prefetch=50,
        verifier_flush=0.05,
        verify=count_nacks,
    ),
    Scenario(
        "8",
        "binding removed mid-flow: mandatory publishes unroutable",
        "unroutable rows end returned with 312 and their reason; nothing else is held up",
        unbind,
        topology=two_keys_topology,
        plan=audit_plan,
        verify=count_returned,
    ),
    Scenario(
        "9",
        "exchange deleted mid-flow (404)",
        "the missing exchange's rows end failed with the reason; the other exchange flows on",
        delete_exchange,
        topology=second_exchange_topology,
        plan=doomed_plan,
        verify=count_failed,
    ),
    Scenario(
        "10",
        "bodies over a lowered max_message_size",
        "an oversized row fails with its reason, the rest of its channel is republished",
        oversized_arrive,
        trigger=0.25,
        plan=oversized_plan,
        setup=lower_max_size,
        verify=count_failed,
        teardown=restore_max_size,
    ),
    Scenario(
        "11a",
        "pg_terminate_backend on the publisher's sessions",
        "a dropped database session costs a retry, never a row",
        terminate_sessions,
        verify=db_errors_seen,
    ),
    Scenario(
        "11b",
        "PostgreSQL restart mid-drain",
        "the outbox database going away and back: the publisher waits and goes on",
        restart_postgres,
        verify=db_errors_seen,
    ),
    Scenario(
        "11d",
        "PostgreSQL crash (kill -9 of every process) mid-drain",
        "write-backs that did not wait for the disk and were undone by the crash only re-publish: "
        "every duplicate is counted, nothing is lost",
        crash_postgres,
        verify=undone_seen,
    ),
    Scenario(
        "11c",
        "PostgreSQL connection reset right after a claim's COMMIT",
        "a claim that committed but whose reply was lost leaves no row stranded in flight",
        lose_commit_reply,
        db_via_proxy=True,
        env=KILL_ENV,
        verify=orphans_seen,
    ),
    Scenario(
        "12",
        "two publishers, one killed",
        "SKIP LOCKED claims never hand a row to both; only the rows the kill left in flight "
        "are published twice",
        kill_one_of_two,
        publishers=2,
        env={**KILL_ENV, **_env(flush_interval=1.0)},
    ),
    Scenario(
        "14",
        "ordered keys: kill -9 of one of two publishers, then a broker kill -9 and restart",
        "rows with an ordering key reach the consumer, first delivery by first delivery, in "
        "their key's order, through a publisher crash and a broker crash; nothing lost",
        kill_one_of_two_ordered,
        publishers=2,
        plan=ordered_plan,
        verify=check_key_order,
        flow=0,
        # small claims and windows: the two publishers share the 400 heads (one would take all)
        env={**KILL_ENV, **_env(flush_interval=0.5, claim_batch=50, window=150)},
        timeout=300,
    ),
    Scenario(
        "16",
        "ordered keys: one of two publishers frozen (SIGSTOP) for two leases, then resumed",
        "a frozen publisher costs only its own rows, for its lease: the other's keys move, the "
        "frozen one's rows come back within a lease, per-key order holds, nothing lost",
        freeze_one_of_two,
        publishers=2,
        plan=ordered_plan,
        verify=check_key_order,
        flow=0,
        env={**KILL_ENV, **_env(flush_interval=0.5, claim_batch=50, window=150)},
        timeout=300,
    ),
    Scenario(
        "16b",
        "unordered rows: one of two publishers frozen (SIGSTOP) for two leases, then resumed",
        "a frozen publisher costs only its own rows, for its lease: the other drains on, the "
        "frozen one's rows come back within a lease, nothing lost",
        freeze_one_of_two,
        publishers=2,
        flow=0,
        env={**KILL_ENV, **_env(flush_interval=0.5, claim_batch=50, window=150)},
    ),
    Scenario(
        "15",
        "consumer kit kill -9 mid-batch, restart",
        "each message's effect happens once at the receiving end: the kit's inbox absorbs the "
        "redeliveries of deliveries whose effect committed before the kill",
        kill_the_consumer,
        trigger=0.1,
        flow=8.0,  # rows still flowing when the kit is killed
        topology=kit_topology,
        setup=start_the_kit,
        verify=check_effects_once,
        teardown=stop_the_kits,
    ),
    Scenario(
        "15b",
        "the consumer kit's database refuses connections for 10 s mid-consume",
        "a failing dependency is not a failing message: the kit pauses, retries, dead-letters "
        "nothing, and each message's effect happens once",
        kit_database_refuses,
        trigger=0.1,
        flow=8.0,
        topology=kit_dlq_topology,
        setup=kit_behind_a_proxy,
        verify=check_outage_effects,
        teardown=stop_the_kits,
    ),
    Scenario(
        "15c",
        "a message that kills the consumer kit's process, kit restarted by a supervisor",
        "its attempts are counted before its handler runs: dead-lettered after the limit, "
        "and every other message's effect happens once",
        poison_waits,
        trigger=0.1,
        flow=8.0,
        topology=kit_dlq_topology,
        setup=start_the_kit_supervised,
        verify=check_poison_dead_lettered,
        teardown=stop_the_kits,
    ),
    Scenario(
        "13",
        "Spark driver kill -9 during a foreachBatch write, restart from checkpoint",
        "a replayed micro-batch adds no outbox row and misses none",
        spark_driver_kill,
        produce=produce_with_spark,
        trigger=0.0,
        timeout=480,
    ),
    Scenario(
        "17a",
        "cluster: kill -9 of the node the publisher is connected to",
        "the publisher moves to another node and republishes what was in flight; every "
        "duplicate counted, nothing lost (quorum queue, verifier on a surviving node)",
        kill_the_publishers_node,
        cluster=True,
        setup=publishers_on_nodes_1_2,
        verify=moved_off_the_killed_node,
        env=CLUSTER_ENV,
    ),
    Scenario(
        "17b",
        "cluster: kill -9 of the quorum queue's leader",
        "a new leader is elected; confirms pause and resume, nothing lost, every duplicate counted",
        kill_the_leader,
        cluster=True,
        setup=verifier_off_the_leader,
        verify=a_new_leader,
        env=CLUSTER_ENV,
    ),
    Scenario(
        "17c",
        "cluster: two of three nodes stopped for a minute, then started",
        "a queue without a majority is a destination outage: rows wait pending, no nack budget "
        "spent, nothing lost; the drain resumes when the majority is back",
        stop_a_majority,
        cluster=True,
        # rows due over 20 s: stopping two nodes takes seconds, and a batch due at once would
        # be drained before the majority is gone (10k rows: the fault landed after the drain)
        flow=20.0,
        trigger=0.1,
        verify=rows_waited_without_spending,
        env=CLUSTER_ENV,
        timeout=360,
    ),
    Scenario(
        "17d",
        "cluster: the publisher's node frozen (SIGSTOP) for 30 s, then resumed",
        "a node that hangs with its sockets open is noticed by heartbeat or confirm timeout: "
        "the publisher moves to another node and republishes; nothing lost, duplicates counted",
        freeze_the_publishers_node,
        cluster=True,
        setup=publishers_on_nodes_1_2,
        verify=_reconnected,
        teardown=thaw_everything,
        flow=8.0,
        env=CLUSTER_ENV,
    ),
    Scenario(
        "17e",
        "cluster: rolling restart of the three nodes during a drain",
        "each node stopped gracefully and started in turn: publishers move, the quorum queue "
        "keeps its majority, no nack budget spent, nothing lost",
        rolling_restart,
        cluster=True,
        # rows due over 60 s: the three restarts take about 40 s on this machine
        flow=60.0,
        trigger=0.05,
        verify=rows_flowed_through_the_restart,
        env=CLUSTER_ENV,
        timeout=360,
    ),
    Scenario(
        "17f",
        "cluster: ordered keys through a kill -9 of the quorum queue's leader",
        "a new leader is elected; rows with an ordering key reach the consumer, first delivery "
        "by first delivery, in their key's order; nothing lost, every duplicate counted",
        kill_the_leader_under_publishers,
        cluster=True,
        publishers=2,
        plan=ordered_plan,
        setup=publishers_on_the_leader,
        verify=ordered_through_the_leader_change,
        flow=4.0,
        env={**CLUSTER_ENV, **_env(claim_batch=50, window=150)},
    ),
    Scenario(
        "17g",
        "cluster: the consumer kit through a kill -9 of its quorum queue's leader",
        "the kit's channel on a surviving node follows the new leader; redeliveries are "
        "absorbed by the inbox: every message's effect exactly once, the kit keeps running",
        kill_the_kit_leader,
        cluster=True,
        trigger=0.1,
        flow=8.0,
        topology=quorum_kit_topology,
        setup=verifier_off_the_kit_leader,
        verify=kit_effects_through_the_leader_change,
        teardown=stop_the_kits,
        env=CLUSTER_ENV,
    ),
    Scenario(
        "17c-long",
        "cluster: two of three nodes stopped for 10 minutes, then started",
        "a quorum queue leaderless for minutes is a destination outage however long it lasts: "
        "rows wait, none nacked or failed, no nack budget spent, nothing lost; all confirmed after",
        stop_a_majority_long,
        cluster=True,
        flow=20.0,
        trigger=0.1,
        verify=long_outage_accounted,
        env=CLUSTER_ENV,
        long=True,
        timeout=LONG_OUTAGE + 400,
    ),
    Scenario(
        "18a",
        "the broker stopped for 10 minutes under a steady producer, then started",
        "a broker gone for minutes costs time, not rows: the publisher retries quietly (the "
        "outage logged at its start, once a minute, and at its end with its length), rows wait, "
        "every committed row confirmed after, no nack budget spent",
        broker_down_long,
        produce=start_producing,
        flow=LONG_FLOW,
        trigger=0.1,
        verify=long_fault_accounted,
        teardown=broker_started,
        long=True,
        timeout=LONG_OUTAGE + 600,
    ),
    Scenario(
        "18b",
        "PostgreSQL stopped for 10 minutes under a steady producer, then started",
        "the outbox's database gone for minutes: the producer's commits fail and are retried, "
        "the publisher waits (the outage logged once, its end with its length), every committed "
        "row confirmed after, nothing lost, duplicates counted",
        postgres_down_long,
        produce=start_producing,
        # the batch due at once: the publisher runs flat out, a window in flight when it stops
        flow=0,
        trigger=0.1,
        verify=long_fault_accounted,
        teardown=postgres_started,
        long=True,
        timeout=LONG_OUTAGE + 600,
    ),
    Scenario(
        "18c",
        "disk alarm held for 3 minutes under a steady producer",
        "a disk alarm blocks publishing (connection.blocked) for as long as it lasts without "
        "failing a row or timing out a confirm; rows wait, all confirmed once it clears",
        disk_alarm_long,
        produce=start_producing,
        flow=LONG_FLOW,
        trigger=0.1,
        verify=long_fault_accounted,
        teardown=reset_disk_limit,
        long=True,
        timeout=DISK_ALARM + 600,
    ),
]
