"""The product: publisher processes draining an outbox, its confirm latency and its memory.

Every publisher runs as its own process (``python -m app.publisher``), configured through
``OUTBOX_*`` like in production. A drain is timed from just before the first process starts to
the newest ``confirmed_at`` in the table, so start-up, claims and all DB bookkeeping count.
Peak RSS is the kernel's ``ru_maxrss`` of the process, read when it exits (``os.wait4``).
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from sqlalchemy import create_engine, func, select

from app.outbox.schema import outbox
from app.outbox.states import Status
from bench.common import (
    Measured,
    Services,
    Sizes,
    libpq_url,
    repeat,
    seed_postgres,
    seed_sqlite,
    temp_postgres,
    temp_sqlite,
    topology,
)
from bench.proccpu import RunCpu, ServiceCpu, describe

REPO_ROOT = Path(__file__).resolve().parents[2]
LATENCY_WARMUP = 3.0
PUBLISHER_ENV = os.environ.get("BENCH_PUBLISHER_ENV", "")  # extra "K=V,K=V" for experiments


@dataclass
class Proc:
    """A publisher process and what it left behind."""

    popen: subprocess.Popen[bytes]
    log: Path
    returncode: int | None = None
    peak_rss_kb: int = 0
    cpu_seconds: float = 0.0

    def wait(self, timeout: float) -> None:
        """Reap the process (``os.wait4`` gives its peak RSS); SIGTERM, then SIGKILL on timeout."""
        deadline = time.monotonic() + timeout
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                self.popen.send_signal(sig)
                deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                pid, status, usage = os.wait4(self.popen.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
                    self.popen.returncode = self.returncode
                    self.peak_rss_kb = usage.ru_maxrss
                    self.cpu_seconds = usage.ru_utime + usage.ru_stime
                    return
                time.sleep(0.02)
        raise RuntimeError(f"publisher {self.popen.pid} did not exit; log: {self.log}")

    def stop(self, timeout: float = 30) -> None:
        self.popen.send_signal(signal.SIGTERM)
        self.wait(timeout)

    def check(self) -> None:
        if self.returncode != 0:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"publisher exited with {self.returncode}:\n{tail}")


def start_publisher(
    services: Services,
    db_url: str,
    logdir: Path,
    *,
    until_empty: bool,
    name: str,
    tracing: bool = False,
    amqp_url: str | None = None,
) -> Proc:
    """A publisher process; ``tracing``: under OpenTelemetry's SDK with
    ``OUTBOX_PUBLISHER_TRACING=true`` (bench/traced_publisher.py); ``amqp_url``: the
    publisher's broker URL when not the services' (a cluster's hosts)."""
    env = dict(os.environ)
    env.update(
        OUTBOX_DATABASE_URL=db_url,
        OUTBOX_AMQP_URL=amqp_url or services.amqp_url,
        OUTBOX_PUBLISHER_METRICS_PORT="0",
        OUTBOX_PUBLISHER_ID=f"bench-{name}-{os.getpid()}",
    )
    for pair in filter(None, PUBLISHER_ENV.split(",")):
        key, _, value = pair.partition("=")
        env[key.strip()] = value.strip()
    module = "app.publisher"
    if tracing:
        env["OUTBOX_PUBLISHER_TRACING"] = "true"
        module = "bench.traced_publisher"
    args = [sys.executable, "-m", module] + (["--until-empty"] if until_empty else [])
    log = logdir / f"publisher-{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Proc(popen=popen, log=log)


def _confirmed(db_url: str) -> tuple[int, dt.datetime | None, dt.datetime | None]:
    """Confirmed rows: how many, the first and the last ``confirmed_at``."""
    engine = create_engine(db_url)
    try:
        at = outbox.c.confirmed_at
        stmt = select(func.count(), func.min(at), func.max(at)).where(
            outbox.c.status == Status.CONFIRMED.value
        )
        with engine.connect() as conn:
            count, first, last = conn.execute(stmt).one()
    finally:
        engine.dispose()
    return int(count), first, last


@dataclass
class DrainResult:
    rows_per_s: float
    seconds: float
    first_confirm_s: float  # process start → first row confirmed (start-up)
    peak_rss_mb: list[float]
    cpu_seconds: list[float]
    duplicates: int
    #: CPU seconds of the services during the drain (PostgreSQL with its backends, RabbitMQ)
    service_cpu: dict[str, float] = field(default_factory=dict)


def drain_once(
    services: Services,
    *,
    backend: str,
    n: int,
    publishers: int = 1,
    keys: int | None = None,
    traced: bool = False,
    tracing: bool = False,
    queue_type: str = "classic",
    publisher_url: str | None = None,
) -> DrainResult:
    """Seed ``n`` rows, run ``publishers`` processes with ``--until-empty``, time the drain.
    ``keys``: rows carry one of that many ordering keys (PostgreSQL), published in key order.
    ``traced``: each row has a ``traceparent`` (PostgreSQL); ``tracing``: the publisher makes
    its batch spans under OpenTelemetry's SDK. ``queue_type`` of the queue; ``publisher_url``:
    the publishers' broker URL (a cluster's hosts) when not ``services.amqp_url`` (which
    declares the topology and counts the queue)."""
    make_db = temp_postgres(services) if backend == "postgresql" else temp_sqlite()
    with (
        make_db as db_url,
        topology(services, f"drain-{backend}", queue_type=queue_type) as topo,
        tempfile.TemporaryDirectory(prefix="outbox-bench-log-") as logdir,
    ):
        if backend == "postgresql":
            seed_postgres(
                db_url,
                n=n,
                exchange=topo.exchange,
                routing_key=topo.routing_key,
                keys=keys,
                traced=traced,
            )
        else:
            seed_sqlite(db_url, n=n, exchange=topo.exchange, routing_key=topo.routing_key)
        services_cpu = ServiceCpu(postgresql=services.database_port, rabbitmq=services.broker_port)
        services_cpu.start()
        start = dt.datetime.now(dt.UTC)
        procs = [
            start_publisher(
                services,
                db_url,
                Path(logdir),
                until_empty=True,
                name=str(i),
                tracing=tracing,
                amqp_url=publisher_url,
            )
            for i in range(publishers)
        ]
        timeout = 120 + n / 500
        for proc in procs:
            proc.wait(timeout)
        for proc in procs:
            proc.check()
        used = services_cpu.stop()
        if tracing:  # the spans were made, not skipped (no SDK, tracing off)
            said = " ".join(p.log.read_text() for p in procs)
            if "spans exported: 0" in said or "spans exported:" not in said:
                raise RuntimeError(
                    f"drain with tracing: no publisher span exported ({said[-300:]})"
                )
        count, first, last = _confirmed(db_url)
        depth = topo.depth()
    if count != n or first is None or last is None:
        raise RuntimeError(f"drain {backend}: {count} of {n} rows confirmed")
    if depth < n:
        raise RuntimeError(f"drain {backend}: {n} rows confirmed but the queue holds {depth}")
    seconds = (last - start).total_seconds()
    return DrainResult(
        rows_per_s=n / seconds,
        seconds=seconds,
        first_confirm_s=(first - start).total_seconds(),
        peak_rss_mb=[p.peak_rss_kb / 1024 for p in procs],
        cpu_seconds=[p.cpu_seconds for p in procs],
        duplicates=depth - n,
        service_cpu=used,
    )


def _drain_repeat(key: str, run: Callable[[], DrainResult]) -> Measured:
    results: list[DrainResult] = []

    def one() -> float:
        result = run()
        results.append(result)
        rss = ", ".join(f"{mb:.0f}" for mb in result.peak_rss_mb)
        cpu = ", ".join(f"{s:.1f}" for s in result.cpu_seconds)
        rows = result.rows_per_s * result.seconds
        per_row = {"publisher": sum(result.cpu_seconds), **result.service_cpu}
        print(
            "    CPU per row: "
            + ", ".join(f"{k} {v / rows * 1e6:.0f} us" for k, v in per_row.items()),
            flush=True,
        )
        print(
            f"    {result.seconds:.2f}s (first confirm at {result.first_confirm_s:.2f}s), "
            f"publisher CPU {cpu}s, peak RSS {rss} MB, "
            f"duplicates {result.duplicates}",
            flush=True,
        )
        return result.rows_per_s

    measured = repeat(key, "rows/s", one)
    measured.extra["peak_rss_mb"] = [max(r.peak_rss_mb) for r in results]
    measured.extra["duplicates"] = sum(r.duplicates for r in results)
    measured.extra["first_confirm_s"] = [r.first_confirm_s for r in results]
    measured.extra["publisher_cpu_s"] = [r.cpu_seconds for r in results]
    measured.extra["cpu_us_per_row"] = [
        {
            "publisher": sum(r.cpu_seconds) / (r.rows_per_s * r.seconds) * 1e6,
            **{k: v / (r.rows_per_s * r.seconds) * 1e6 for k, v in r.service_cpu.items()},
        }
        for r in results
    ]
    return measured


def run_drains(services: Services, sizes: Sizes) -> list[Measured]:
    n = sizes.drain
    hot = max(200, n // 100)
    return [
        _drain_repeat("drain_postgres", lambda: drain_once(services, backend="postgresql", n=n)),
        _drain_repeat("drain_sqlite", lambda: drain_once(services, backend="sqlite", n=n)),
        _drain_repeat(
            "drain_postgres_2_publishers",
            lambda: drain_once(services, backend="postgresql", n=n, publishers=2),
        ),
        # per-key order (docs/guarantees.md section 5): many keys in parallel, and one hot key
        # whose rate is bounded by one publish -> confirm -> write-back -> claim cycle per row
        _drain_repeat(
            "drain_postgres_ordered_10k_keys",
            lambda: drain_once(services, backend="postgresql", n=n, keys=10_000),
        ),
        _drain_repeat(
            "drain_postgres_ordered_hot_key",
            lambda: drain_once(services, backend="postgresql", n=hot, keys=1),
        ),
    ]


def run_tracing(services: Services, sizes: Sizes) -> list[Measured]:
    """The cost of ``OUTBOX_PUBLISHER_TRACING``: the same rows, each with a ``traceparent``,
    drained without and with the publisher's batch spans (SDK, batch processor, spans dropped
    by the exporter)."""
    n = sizes.drain
    return [
        _drain_repeat(
            "drain_postgres_traceparent_rows",
            lambda: drain_once(services, backend="postgresql", n=n, traced=True),
        ),
        _drain_repeat(
            "drain_postgres_publisher_tracing",
            lambda: drain_once(services, backend="postgresql", n=n, traced=True, tracing=True),
        ),
    ]


#: the three-node cluster of ``deploy/local/cluster.sh``: node N on BENCH_CLUSTER_PORT + N - 1
CLUSTER_SCRIPT = REPO_ROOT / "deploy" / "local" / "cluster.sh"


def _cluster(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["OUTBOX_CLUSTER_PORT"] = os.environ.get("BENCH_CLUSTER_PORT", "5691")
    return subprocess.run(
        [str(CLUSTER_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


def run_quorum_drain(services: Services, sizes: Sizes) -> list[Measured]:
    """The drain into a quorum queue on the local three-node cluster (started here when not
    running, stopped afterwards if so), the publisher given the three hosts: beside
    ``drain_postgres`` (one node, a classic queue) in the same run. Service CPU counts node 1."""
    base = int(os.environ.get("BENCH_CLUSTER_PORT", "5691"))
    ports = [base, base + 1, base + 2]
    running = _cluster("status").stdout.count(": running") == 3
    if not running:
        started = _cluster("start")
        if started.returncode != 0:
            raise RuntimeError(f"cluster.sh start failed: {started.stderr[-2000:]}")
    try:
        node1 = Services(
            amqp_url=f"amqp://guest:guest@127.0.0.1:{ports[0]}/",
            database_url=services.database_url,
        )
        hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
        url = f"amqp://guest:guest@{hosts}/"
        n = sizes.drain
        drained = _drain_repeat(
            "drain_postgres_quorum_3_nodes",
            lambda: drain_once(
                node1, backend="postgresql", n=n, queue_type="quorum", publisher_url=url
            ),
        )
        # at half the quorum drain's own rate, as the single node's latency is at half its own
        latency = run_latency(
            node1,
            sizes,
            drain_rate=drained.value,
            queue_type="quorum",
            publisher_url=url,
            prefix="quorum_confirm_latency",
        )
        return [drained, *latency]
    finally:
        if not running:
            _cluster("stop")


def run_memory(services: Services, sizes: Sizes, *, one_x: list[float] | None = None) -> Measured:
    """Peak RSS of one publisher draining N rows and 4N rows (PostgreSQL).

    ``one_x``: the peak RSS of the ``drain_postgres`` runs (N rows each), when they ran, so only
    the 4N drain runs here."""
    out = Measured(key="publisher_peak_rss_mb", unit="MB")
    if one_x:
        out.runs.extend(one_x)
    else:
        out.runs.append(drain_once(services, backend="postgresql", n=sizes.drain).peak_rss_mb[0])
    print(
        f"  publisher peak RSS draining {sizes.drain:,} rows: "
        + ", ".join(f"{mb:.1f}" for mb in out.runs)
        + " MB",
        flush=True,
    )
    result = drain_once(services, backend="postgresql", n=sizes.drain * 4)
    four = result.peak_rss_mb[0]
    out.extra.update(peak_rss_mb_1x=out.value, peak_rss_mb_4x=four, rows_per_s_4x=result.rows_per_s)
    print(
        f"  publisher peak RSS draining {sizes.drain * 4:,} rows: {four:.1f} MB "
        f"({result.rows_per_s:,.0f} rows/s)",
        flush=True,
    )
    return out


# ----------------------------------------------------------------------------- latency


def _produce(db_url: str, *, rate: float, seconds: float, exchange: str, key: str) -> int:
    """Insert rows at a steady ``rate`` for ``seconds`` (one small INSERT every 20 ms)."""
    insert = (
        "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body) "
        "SELECT %(prefix)s || g, 'bench:latency', %(ex)s, %(rk)s, %(body)s "
        "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g"
    )
    body = bytes(range(256))
    done = 0
    start = time.monotonic()
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        while (elapsed := time.monotonic() - start) < seconds:
            due = int(elapsed * rate) - done
            if due > 0:
                conn.execute(
                    insert,
                    {
                        "prefix": "lat-",
                        "ex": exchange,
                        "rk": key,
                        "body": body,
                        "lo": done,
                        "hi": done + due - 1,
                    },
                )
                done += due
            time.sleep(0.02)
    return done


#: Rows not settled yet, each status counted from its own partial index: ``status IN (...)``
#: proves neither index's predicate and reads the whole table (0.35-0.58 s on a 0.6-1.1 GB
#: outbox, on both cores: load the soak's sampler added every 10 s).
OPEN_ROWS = (
    "SELECT (SELECT count(*) FROM outbox WHERE status = 'pending') "
    "+ (SELECT count(*) FROM outbox WHERE status = 'in_flight')"
)


def _wait_drained(db_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(OPEN_ROWS).fetchone()
            if row is not None and row[0] == 0:
                return
            time.sleep(0.1)
    raise RuntimeError("latency run: the publisher did not catch up")


def _percentiles(db_url: str, since: dt.datetime) -> dict[str, float]:
    """p50 and p99 in ms of created → confirmed (``total``), and of its two legs: created →
    claimed (``claim``: the wake-up and the claim) and claimed → confirmed (``settle``: the
    publish, the broker's confirm and the write-back)."""
    legs = {
        "total": ("created_at", "confirmed_at"),
        "claim": ("created_at", "claimed_at"),
        "settle": ("claimed_at", "confirmed_at"),
        "publish": ("claimed_at", "published_at"),
        "ack": ("published_at", "confirmed_at"),
    }
    cols = ", ".join(
        f"percentile_cont({q}) WITHIN GROUP (ORDER BY extract(epoch FROM {b} - {a}) * 1000)"
        for a, b in legs.values()
        for q in (0.5, 0.99)
    )
    query = (
        f"SELECT count(*), {cols} FROM outbox "
        "WHERE status = 'confirmed' AND created_at >= %(since)s"
    )
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute(query, {"since": since}).fetchone()
        # the publisher's own histogram of publish -> broker ack (bucket bounds, seconds)
        report = conn.execute("SELECT stats FROM outbox_publishers").fetchone()
    assert row is not None
    out = {"count": float(row[0])}
    for i, leg in enumerate(legs):
        out[f"{leg}_p50"], out[f"{leg}_p99"] = float(row[1 + 2 * i]), float(row[2 + 2 * i])
    stats = report[0] if report is not None and isinstance(report[0], dict) else {}
    for q in ("p50", "p99"):
        value = stats.get(f"confirm_latency_{q}")
        if value is not None:
            out[f"broker_{q}"] = float(value) * 1000
    return out


def run_latency(
    services: Services,
    sizes: Sizes,
    *,
    drain_rate: float,
    queue_type: str = "classic",
    publisher_url: str | None = None,
    prefix: str = "confirm_latency",
) -> list[Measured]:
    """Rows committed at 50% of the measured drain rate; latency = created_at → confirmed_at.
    ``queue_type``, ``publisher_url``: as for :func:`drain_once` (a quorum queue on the
    cluster); ``prefix`` of the two keys (``<prefix>_p50_ms``, ``<prefix>_p99_ms``)."""
    rate = 0.5 * drain_rate
    seconds = LATENCY_WARMUP + sizes.latency_seconds
    with (
        temp_postgres(services) as db_url,
        topology(services, "latency", queue_type=queue_type) as topo,
        tempfile.TemporaryDirectory(prefix="outbox-bench-log-") as logdir,
    ):
        # CPU over the whole run (warm-up and start-up included), per row produced
        with RunCpu(
            "producer", postgresql=services.database_port, rabbitmq=services.broker_port
        ) as used:
            proc = start_publisher(
                services,
                db_url,
                Path(logdir),
                until_empty=False,
                name="lat",
                amqp_url=publisher_url,
            )
            try:
                time.sleep(1.0)  # let it connect before rows arrive
                steady_from = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=LATENCY_WARMUP)
                produced = _produce(
                    db_url, rate=rate, seconds=seconds, exchange=topo.exchange, key=topo.routing_key
                )
                _wait_drained(db_url, timeout=60 + produced / 1000)
            finally:
                proc.stop()
        proc.check()
        got = _percentiles(db_url, steady_from)
    rows = max(1, produced)
    cpu = {"publisher": proc.cpu_seconds / rows * 1e6, **used.per_message(rows)}
    p50, p99, count = got["total_p50"], got["total_p99"], int(got["count"])
    print(
        f"  {prefix} ({queue_type}) at {rate:,.0f} rows/s over {count:,} rows: "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms; created -> claimed p50 {got['claim_p50']:.1f}, "
        f"p99 {got['claim_p99']:.1f}; claimed -> confirmed p50 {got['settle_p50']:.1f}, "
        f"p99 {got['settle_p99']:.1f} (claimed -> published p50 {got['publish_p50']:.1f}, p99 "
        f"{got['publish_p99']:.1f}; published -> confirmed written p50 {got['ack_p50']:.1f}, "
        f"p99 {got['ack_p99']:.1f}); publish -> broker ack p50 "
        f"{got.get('broker_p50', -1):.1f}, p99 {got.get('broker_p99', -1):.1f} "
        f"(histogram bucket bounds); CPU per row: {describe(cpu)}",
        flush=True,
    )
    legs = {f"latency_{k}_ms": round(v, 2) for k, v in got.items() if k != "count"}
    extra = {
        "latency_rate_rows_per_s": rate,
        "latency_rows": count,
        **legs,
        "cpu_us_per_msg_by_process": [cpu],
    }
    return [
        Measured(key=f"{prefix}_p50_ms", unit="ms", runs=[p50], extra=extra),
        Measured(key=f"{prefix}_p99_ms", unit="ms", runs=[p99]),
    ]
