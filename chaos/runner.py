"""One scenario, start to finish: fresh database and topology, the batch, the publisher(s), the
verifier, the fault, the drain, and the accounting of every row.

The accounting (:func:`evaluate`) reads three independent records: the outbox rows (where each
row ended and why), the verifier's table (what reached a consumer, how often), and the product's
own duplicate counter (``lost_confirms``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import itertools
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, make_url

from chaos import outbox as ob
from chaos import procs
from chaos.amqp import Topology
from chaos.outbox import Databases, Expect, FinalRow, PlannedRow
from chaos.proxy import LostCommitReply, TcpProxy
from chaos.services import REPO, Cluster, PrivateServices
from chaos.verifier import Received, Verifier

log = logging.getLogger(__name__)

OPEN = ("pending", "in_flight")
WINDOW = 1000
VERIFIER_DB = ob.KEEP_DB


class ScenarioError(Exception):
    """The scenario could not be carried out as planned (not a verdict on the product)."""


# ---------------------------------------------------------------- the environment


@dataclass
class MatrixEnv:
    """The private services, the template database and the verifier's database."""

    services: PrivateServices
    dbs: Databases
    verifier_db_url: str
    log_dir: Path
    cluster: Cluster = field(default_factory=Cluster.for_matrix)
    cluster_started: bool = False

    def ensure_cluster(self) -> Cluster:
        """The matrix's three-node cluster, started on first need (and all three nodes running
        again after a scenario that killed or stopped some)."""
        self.cluster.start()
        self.cluster_started = True
        return self.cluster

    @classmethod
    def open(cls, services: PrivateServices, *, log_dir: Path | None = None) -> MatrixEnv:
        services.start()
        dbs = Databases(services.pg_url())
        dbs.prepare()
        verifier_db_url = dbs.ensure(VERIFIER_DB)
        Verifier.ensure_schema(verifier_db_url)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return cls(
            services=services,
            dbs=dbs,
            verifier_db_url=verifier_db_url,
            log_dir=log_dir or services.local_dir / "logs" / stamp,
        )

    def close(self, *, stop_services: bool = True) -> None:
        procs.kill_all()
        with contextlib.suppress(Exception):
            self.dbs.dispose()
        if stop_services:
            self.services.stop()
            if self.cluster_started:
                with contextlib.suppress(Exception):
                    self.cluster.stop()


# ---------------------------------------------------------------- scenario description

Step = Callable[["Ctx"], Awaitable[None]]
Planner = Callable[["Ctx"], list[PlannedRow]]


@dataclass(frozen=True)
class Scenario:
    """A fault and what it must not break.

    ``trigger``: fraction of the batch confirmed before ``inject`` runs. ``flow``: seconds over
    which the batch becomes due, evenly (0: all due at once). ``env``: publisher settings on top of
    :data:`chaos.procs.PUBLISHER_ENV`.
    """

    key: str
    title: str
    proves: str
    inject: Step
    trigger: float = 0.3
    flow: float = 3.0
    env: Mapping[str, str] = field(default_factory=dict)
    via_proxy: bool = False
    db_via_proxy: bool = False
    publishers: int = 1
    plan: Planner | None = None
    topology: Callable[[Ctx], Topology] | None = None
    #: runs first, before the topology is declared: may point the scenario at services of its
    #: own (``ctx.use_database`` for the outbox, ``verifier_url`` and ``publishers_url`` for
    #: the broker); ``teardown`` stops them
    prepare: Step | None = None
    setup: Step | None = None
    verify: Step | None = None
    teardown: Step | None = None
    produce: Step | None = None
    verifier_prefetch: int = 500
    verifier_flush: float = 0.05
    #: what records the deliveries instead of the AMQP :class:`~chaos.verifier.Verifier` on the
    #: topology's queues: an object with its ``start``, ``stop``, ``settle`` and ``results``
    #: (:class:`chaos.streams.StreamVerifier` reads a stream whole)
    verifier: Callable[[Ctx, Topology], Any] | None = None
    #: a fault that lasts minutes: ``make chaos-long`` only (``python -m chaos.run --long``)
    long: bool = False
    #: on the matrix's three-node cluster, into a quorum queue (the publisher gets a multi-host
    #: URL, the verifier a node of its own that the scenario keeps alive)
    cluster: bool = False
    settle_timeout: float = 60.0  # most wait for the verifier to see every confirmed row
    timeout: float = 240.0

    @property
    def window(self) -> int:
        return int(self.env.get("OUTBOX_WINDOW", procs.PUBLISHER_ENV["OUTBOX_WINDOW"]))


# ---------------------------------------------------------------- what a run found


@dataclass
class Result:
    key: str
    title: str
    rows: int
    confirmed: int = 0
    terminal: dict[str, int] = field(default_factory=dict)  # "returned 312 ...": n
    lost: int = 0
    stuck: int = 0
    unexpected: int = 0
    extra_rows: int = 0
    duplicates: int = 0
    redeliveries: int = 0
    allowed: int = 0
    product_dups: int = 0
    at_fault: str = ""
    recovery: float | None = None
    stall: float | None = None
    checks: list[tuple[str, bool]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def failed_checks(self) -> list[str]:
        return [name for name, ok in self.checks if not ok]

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.lost == 0
            and self.unexpected == 0
            and self.extra_rows == 0
            and self.duplicates <= self.allowed
            and self.duplicates <= self.product_dups
            and not self.failed_checks
        )

    def explain(self) -> str:
        lines = [f"{self.key} {self.title}: {'ok' if self.ok else 'FAILED'}"]
        if self.error:
            lines.append(f"  error: {self.error}")
        lines.append(
            f"  rows {self.rows} confirmed {self.confirmed} terminal {self.terminal} "
            f"lost {self.lost} (stuck {self.stuck}) unexpected {self.unexpected} "
            f"extra rows {self.extra_rows}"
        )
        lines.append(
            f"  duplicates {self.duplicates} (allowed {self.allowed}, product counted "
            f"{self.product_dups}), consumer redeliveries "
            f"{self.redeliveries}"
        )
        lines.append(f"  at fault {self.at_fault}; recovery {self.recovery}s; stall {self.stall}s")
        lines.extend(f"  check {'ok ' if ok else 'FAIL'} {name}" for name, ok in self.checks)
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


# ---------------------------------------------------------------- the context a scenario sees


@dataclass
class Ctx:
    env: MatrixEnv
    scenario: Scenario
    rows: int
    run: str
    db_name: str
    db_url: str
    engine: Engine
    names: dict[str, str]
    result: Result
    log_dir: Path
    proxy: TcpProxy | None = None
    db_proxy: TcpProxy | None = None
    lost_commit: LostCommitReply | None = None
    verifier: Verifier | None = None
    publishers: list[procs.Proc] = field(default_factory=list)
    killed: list[procs.Proc] = field(default_factory=list)
    expect: dict[str, Expect] = field(default_factory=dict)
    dup_scope: set[str] | None = None
    fault_mono: float | None = None
    fault_wall: float | None = None
    data: dict[str, Any] = field(default_factory=dict)
    #: a cluster scenario: the verifier's (and the topology's) node, and the publishers' URL
    verifier_url: str | None = None
    publishers_url: str | None = None
    #: publisher settings of this run on top of the scenario's (a stream URL found at run time)
    publisher_env: dict[str, str] = field(default_factory=dict)

    @property
    def services(self) -> PrivateServices:
        return self.env.services

    @property
    def cluster(self) -> Cluster:
        return self.env.cluster

    @property
    def amqp_url(self) -> str:
        return self.verifier_url or self.env.services.amqp_url

    # ------------------------------------------------------------ helpers for scenarios

    def note(self, text: str) -> None:
        self.result.notes.append(text)

    def check(self, name: str, ok: bool) -> bool:
        self.result.checks.append((name, bool(ok)))
        return ok

    async def ctl(self, *args: str) -> str:
        return await asyncio.to_thread(self.services.ctl, *args)

    async def counts(self) -> collections.Counter[str]:
        return await asyncio.to_thread(ob.status_counts, self.engine)

    async def wait_counts(
        self, predicate: Callable[[collections.Counter[str]], bool], *, timeout: float, what: str
    ) -> collections.Counter[str]:
        deadline = time.monotonic() + timeout
        while True:
            counts = await self.counts()
            if predicate(counts):
                return counts
            if time.monotonic() > deadline:
                raise ScenarioError(
                    f"timed out after {timeout:.0f}s waiting for {what}: {dict(counts)}"
                )
            await asyncio.sleep(0.05)

    async def fault_now(self, what: str) -> None:
        """Mark the moment of injection (call right before the fault) and what the DB says."""
        self.fault_mono, self.fault_wall = time.monotonic(), time.time()
        counts = await self.counts()
        done = sum(n for s, n in counts.items() if s not in OPEN)
        self.result.at_fault = f"{done}/{self.rows}"
        self.note(
            f"fault: {what} with {counts.get('confirmed', 0)} confirmed, "
            f"{counts.get('in_flight', 0)} in flight, {counts.get('pending', 0)} pending"
        )
        self.data["landed"] = False

    async def landed(self) -> None:
        """Call once the fault has taken effect: rows must still be open (a fault that lands
        after the drain proves nothing)."""
        if self.data.get("landed", True):
            return
        self.data["landed"] = True
        counts = await self.counts()
        still = sum(counts.get(s, 0) for s in OPEN)
        self.note(f"fault in effect with {still} rows still pending or in flight")
        if self.scenario.produce is None:  # a Spark scenario's rows arrive over time
            self.check("fault landed mid-flow", still > 0 and counts.get("confirmed", 0) > 0)

    def use_database(self, url: str) -> None:
        """The outbox of this scenario lives at ``url`` (schema there already): the runner's
        engine and the publishers follow it. The matrix's own database stays unused."""
        self.engine.dispose()
        self.db_url = url
        self.engine = ob.runner_engine(url)

    def publisher_url(self) -> str:
        if self.publishers_url is not None:
            return self.publishers_url
        if self.scenario.via_proxy:
            assert self.proxy is not None
            return self.proxy.url_for(self.amqp_url)
        return self.amqp_url

    def publisher_db_url(self) -> str:
        if self.db_proxy is None:
            return self.db_url
        url = make_url(self.db_url).set(port=self.db_proxy.port)
        url = url.update_query_dict({"sslmode": "disable", "gssencmode": "disable"})
        return url.render_as_string(hide_password=False)

    async def spawn_publisher(
        self, name: str | None = None, env: Mapping[str, str] | None = None
    ) -> procs.Proc:
        name = name or f"{self.run}-p{len(self.publishers) + 1}"
        proc = procs.publisher(
            name=name,
            db_url=self.publisher_db_url(),
            amqp_url=self.publisher_url(),
            log_path=self.log_dir / f"{name}.log",
            env={**self.scenario.env, **self.publisher_env, **(env or {})},
        )
        proc.start()
        self.publishers.append(proc)
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(ob.registered, self.engine, name):
            if not proc.alive():
                raise ScenarioError(f"publisher {name} exited: {proc.log_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise ScenarioError(f"publisher {name} did not register within 60s")
            await asyncio.sleep(0.1)
        return proc

    async def kill9(self, proc: procs.Proc) -> None:
        """kill -9 a publisher (it stays dead; ``spawn_publisher`` starts another)."""
        self.killed.append(proc)
        code = await asyncio.to_thread(proc.kill9)
        self.check(f"publisher {proc.name} died of SIGKILL", code == -9)

    def snapshot_in_flight(self, owner: str | None = None) -> set[str]:
        return ob.in_flight_ids(self.engine, owner=owner)


# ---------------------------------------------------------------- running one scenario


def default_plan(ctx: Ctx) -> list[PlannedRow]:
    ex, rk = ctx.names["exchange"], "rk"
    return [PlannedRow(f"{ctx.run}-{i:06d}", ex, rk, ob.body_for(i)) for i in range(ctx.rows)]


def default_topology(ctx: Ctx, queue_args: Mapping[str, Any] | None = None) -> Topology:
    ex, q = ctx.names["exchange"], ctx.names["queue"]
    return Topology(exchanges=[ex], queues={q: dict(queue_args or {})}, bindings=[(ex, q, "rk")])


async def run_scenario(env: MatrixEnv, scenario: Scenario, *, rows: int) -> Result:
    """Run one scenario; never raises for the product's or the harness's failures (they are in
    the result), and leaves no process and no topology behind."""
    started = time.monotonic()
    run = f"s{scenario.key}-{uuid.uuid4().hex[:6]}"
    result = Result(key=scenario.key, title=scenario.title, rows=rows)
    db_name = await asyncio.to_thread(env.dbs.create, f"chaos_{scenario.key}")
    db_url = env.dbs.url(db_name)
    engine = ob.runner_engine(db_url)
    names = {"exchange": f"chaos.{run}", "queue": f"chaos.{run}"}
    ctx = Ctx(
        env=env,
        scenario=scenario,
        rows=rows,
        run=run,
        db_name=db_name,
        db_url=db_url,
        engine=engine,
        names=names,
        result=result,
        log_dir=env.log_dir / run,
    )
    if scenario.cluster:
        await asyncio.to_thread(env.ensure_cluster)
        ctx.verifier_url, ctx.publishers_url = env.cluster.node_url(3), env.cluster.url
    quorum = {"x-queue-type": "quorum"} if scenario.cluster else None
    topology = scenario.topology(ctx) if scenario.topology else default_topology(ctx, quorum)
    try:
        async with asyncio.timeout(scenario.timeout):
            if scenario.prepare is not None:
                await scenario.prepare(ctx)
            await _run(ctx, topology)
    except (ScenarioError, TimeoutError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except Exception as exc:  # a harness bug: report it with the rest, keep the matrix going
        log.exception("scenario %s crashed", scenario.key)
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        await _cleanup(ctx, topology)
    if result.error is not None and ctx.expect and not ctx.data.get("evaluated"):
        with contextlib.suppress(Exception):  # what the rows say even so (stuck rows: lost)
            await asyncio.to_thread(evaluate, ctx)
    if result.ok:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(env.dbs.drop, db_name)
    else:
        result.notes.append(f"kept database {db_name}, logs in {ctx.log_dir.relative_to(REPO)}")
    result.seconds = round(time.monotonic() - started, 1)
    return result


async def _run(ctx: Ctx, topology: Topology) -> None:
    sc = ctx.scenario
    ctx.result.allowed = sc.window
    await topology.declare(ctx.amqp_url)
    if sc.setup is not None:
        await sc.setup(ctx)
    if sc.via_proxy:
        ctx.proxy = TcpProxy("127.0.0.1", ctx.services.amqp_port)
        await ctx.proxy.start()
    if sc.db_via_proxy:
        ctx.lost_commit = LostCommitReply()
        ctx.db_proxy = TcpProxy("127.0.0.1", ctx.services.pg_port, tap_factory=ctx.lost_commit.tap)
        await ctx.db_proxy.start()
    if sc.verifier is not None:
        ctx.verifier = sc.verifier(ctx, topology)
    else:
        ctx.verifier = Verifier(
            amqp_url=ctx.amqp_url,
            db_url=ctx.env.verifier_db_url,
            run=ctx.run,
            queues=topology.verified,
            prefetch=sc.verifier_prefetch,
            flush_interval=sc.verifier_flush,
        )
    await ctx.verifier.start()
    for i in range(sc.publishers):
        await ctx.spawn_publisher(f"{ctx.run}-{'ab'[i] if sc.publishers > 1 else 'p1'}")
    if sc.produce is not None:
        await sc.produce(ctx)
    else:
        await insert_batch(ctx)
    target = max(1, int(sc.trigger * ctx.rows))
    await ctx.wait_counts(
        lambda c: c.get("confirmed", 0) >= target,
        timeout=120,
        what=f"{target} confirmed rows before the fault",
    )
    await sc.inject(ctx)
    if ctx.fault_mono is None:
        raise ScenarioError("the scenario never marked its fault")
    await ctx.landed()
    await _drain(ctx)
    await _settle_and_stop(ctx)
    if sc.verify is not None:
        await sc.verify(ctx)
    await asyncio.to_thread(evaluate, ctx)


async def insert_batch(ctx: Ctx) -> None:
    """The scenario's batch (its plan, or the default one), due over the scenario's flow."""
    plan = (ctx.scenario.plan or default_plan)(ctx)
    ctx.expect = {row.message_id: row.expect for row in plan}
    await asyncio.to_thread(
        ob.insert_rows,
        ctx.engine,
        plan,
        batch_id=f"{ctx.run}:1",
        start=time.time() + 0.2,
        flow=ctx.scenario.flow,
    )


async def _drain(ctx: Ctx) -> None:
    """Wait until no row of the batch is pending or in flight (bounded: stuck rows are lost)."""
    budget = max(60.0, ctx.rows / 200)
    deadline = time.monotonic() + budget
    while True:
        counts = await ctx.counts()
        if not any(counts.get(s, 0) for s in OPEN):
            break
        if time.monotonic() > deadline:
            ctx.note(f"drain did not finish within {budget:.0f}s: {dict(counts)}")
            return
        await asyncio.sleep(0.05)
    assert ctx.fault_mono is not None
    ctx.result.recovery = round(time.monotonic() - ctx.fault_mono, 2)


async def _settle_and_stop(ctx: Ctx) -> None:
    assert ctx.verifier is not None
    rows = await asyncio.to_thread(ob.final_rows, ctx.engine)
    expected = {
        r.message_id for r in rows if r.status == "confirmed" and r.message_id in ctx.expect
    }
    wait = ctx.scenario.settle_timeout
    if not await ctx.verifier.settle(expected, timeout=wait):
        ctx.note(f"verifier did not receive every confirmed row within {wait:.0f}s")
    for proc in ctx.publishers:
        if proc in ctx.killed:
            continue
        if not proc.alive():
            ctx.check(
                f"publisher {proc.name} still running at the end "
                f"(exited {proc.popen.returncode if proc.popen else None})",
                False,
            )
            continue
        code = await asyncio.to_thread(proc.terminate, timeout=30)
        ctx.check(f"publisher {proc.name} stopped cleanly on SIGTERM", code == 0)


async def _cleanup(ctx: Ctx, topology: Topology) -> None:
    if ctx.verifier is not None:
        with contextlib.suppress(Exception):
            await ctx.verifier.stop()
    for proc in ctx.publishers:
        if proc.alive():
            await asyncio.to_thread(proc.kill9)
    for proxy in (ctx.proxy, ctx.db_proxy):
        if proxy is not None:
            await proxy.close()
    if ctx.scenario.teardown is not None:
        try:
            await ctx.scenario.teardown(ctx)
        except Exception as exc:
            ctx.note(f"teardown failed: {exc!r}")
    if ctx.scenario.cluster:  # every node back for the next scenario
        try:
            await asyncio.to_thread(ctx.env.ensure_cluster)
        except Exception as exc:
            ctx.note(f"cluster restart failed: {exc!r}")
    with contextlib.suppress(Exception):
        await topology.delete(ctx.amqp_url)
    ctx.engine.dispose()


# ---------------------------------------------------------------- accounting


def evaluate(ctx: Ctx) -> None:
    """Fill the result from the outbox rows, the verifier's table and the product's counter."""
    assert ctx.verifier is not None
    ctx.data["evaluated"] = True
    res = ctx.result
    rows = ob.final_rows(ctx.engine)
    got = ctx.verifier.results()
    by_id = {r.message_id: r for r in rows}
    res.extra_rows += sum(1 for m in by_id if m not in ctx.expect)
    for message_id, expect in ctx.expect.items():
        _account(res, expect, by_id.get(message_id), got)
    res.confirmed = sum(1 for r in rows if r.status == "confirmed")
    res.product_dups = sum(r.lost_confirms for r in rows if r.message_id in ctx.expect)
    res.duplicates = got.duplicates
    res.redeliveries = got.redeliveries
    if ctx.dup_scope is not None:
        outside = got.duplicated_ids() - ctx.dup_scope
        ctx.check(
            f"duplicates only among the {len(ctx.dup_scope)} rows the kill left in flight "
            f"({len(outside)} outside)",
            not outside,
        )
    stray = got.ids - set(ctx.expect)
    if stray:
        ctx.note(f"verifier received {len(stray)} message ids that are not in the batch")
    res.stall = _stall(rows, ctx.fault_wall)


def _account(res: Result, expect: Expect, row: FinalRow | None, got: Received) -> None:
    if row is None:
        res.lost += 1  # the row never reached the outbox
        return
    if row.status in OPEN:
        res.lost += 1
        res.stuck += 1
        return
    if row.status == "confirmed":
        if row.message_id not in got.copies:
            res.lost += 1
        if expect.status != "confirmed" and not expect.or_confirmed:
            res.unexpected += 1
        return
    label = _label(row.status, row.reason)
    fits = row.status == expect.status and expect.needle in row.reason
    if not fits:
        res.unexpected += 1
        label = f"UNEXPECTED {label}"
    res.terminal[label] = res.terminal.get(label, 0) + 1


def _label(status: str, reason: str) -> str:
    """``returned 312 NO_ROUTE``, ``failed 404 NOT_FOUND``, else the status and the reason."""
    code = re.search(r"\b([1-5]\d\d) ([A-Z][A-Z_]+)", reason)
    if code is not None:
        return f"{status} {code.group(1)} {code.group(2)}"
    return f"{status}: {_short(reason)}"


def _short(reason: str, width: int = 60) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= width else reason[: width - 1] + "…"


def _stall(rows: list[FinalRow], fault_wall: float | None) -> float | None:
    """The longest stretch without any confirm, from the fault to the last confirm."""
    if fault_wall is None:
        return None
    start = dt.datetime.fromtimestamp(fault_wall, tz=dt.UTC)
    stamps = sorted(r.confirmed_at for r in rows if r.confirmed_at and r.confirmed_at >= start)
    if not stamps:
        return None
    points = [start, *stamps]
    return round(max((b - a).total_seconds() for a, b in itertools.pairwise(points)), 2)
