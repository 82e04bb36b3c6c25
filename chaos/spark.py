"""Scenario 13's producer: a Spark Structured Streaming driver writes the batch through
``OutboxSink``; it is killed (``kill -9`` of its whole process group: Python driver, JVM,
Python workers) while a micro-batch is half written, then restarted from its checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from pathlib import Path

from sqlalchemy import text

from chaos import procs
from chaos.outbox import CONFIRMED, retrying
from chaos.runner import Ctx, ScenarioError

FILES = 5
HOLD_BATCH = 1
HOLD_SECONDS = 4.0
SPARK_START_TIMEOUT = 180.0


def write_input(directory: Path, *, rows: int, files: int = FILES) -> None:
    """``rows`` JSON lines ``{"n": i, "payload": "chaos-row i …"}`` spread over ``files`` files."""
    directory.mkdir(parents=True, exist_ok=True)
    per = -(-rows // files)
    for f in range(files):
        lines = [
            json.dumps({"n": i, "payload": f"chaos-row {i:07d} " + "x" * 238})
            for i in range(f * per, min(rows, (f + 1) * per))
        ]
        tmp = directory / f".part-{f}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.rename(directory / f"part-{f:03d}.json")


def _driver(
    ctx: Ctx, work: Path, *, hold: bool, name: str, extra: tuple[str, ...] = ()
) -> procs.Proc:
    markers = work / f"markers-{name[-1]}"
    markers.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "chaos.spark_job",
        "--url",
        ctx.db_url,
        "--input",
        str(work / "input"),
        "--checkpoint",
        str(work / "checkpoint"),
        "--markers",
        str(markers),
        "--sink",
        ctx.data["sink"],
        "--exchange",
        ctx.names["exchange"],
    ]
    if hold:
        argv += ["--hold-batch", str(HOLD_BATCH), "--hold", str(HOLD_SECONDS)]
    argv += list(extra)
    env = procs.clean_env(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    return procs.Proc(name=name, argv=argv, env=env, log_path=ctx.log_dir / f"{name}.log")


async def _wait_file(ctx: Ctx, proc: procs.Proc, directory: Path, pattern: str) -> None:
    deadline = time.monotonic() + SPARK_START_TIMEOUT
    while not list(directory.glob(pattern)):
        if not proc.alive():
            raise ScenarioError(f"Spark driver ended before {pattern}: {proc.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise ScenarioError(f"no {pattern} within {SPARK_START_TIMEOUT:.0f}s")
        await asyncio.sleep(0.05)


def _sink_rows(ctx: Ctx) -> list[tuple[str, bytes]]:
    sql = text("SELECT message_id, body FROM outbox WHERE batch_id LIKE :p")

    def run() -> list[tuple[str, bytes]]:
        with ctx.engine.connect() as conn:
            return [(m, bytes(b)) for m, b in conn.execute(sql, {"p": f"{ctx.data['sink']}:%"})]

    return retrying(run)


def _batch_rows(ctx: Ctx, spark_batch: int) -> int:
    sql = text("SELECT count(*) FROM outbox WHERE batch_id = :b")

    def run() -> int:
        with ctx.engine.connect() as conn:
            return int(conn.execute(sql, {"b": f"{ctx.data['sink']}:{spark_batch}"}).scalar_one())

    return retrying(run)


def _recorded(ctx: Ctx) -> int:
    sql = text("SELECT count(*) FROM outbox_batches WHERE sink = :s")

    def run() -> int:
        with ctx.engine.connect() as conn:
            return int(conn.execute(sql, {"s": ctx.data["sink"]}).scalar_one())

    return retrying(run)


async def produce_with_spark(ctx: Ctx) -> None:
    work = ctx.log_dir / "spark"
    ctx.data["sink"] = f"chaos-{ctx.run}"
    await asyncio.to_thread(write_input, work / "input", rows=ctx.rows)
    first = _driver(ctx, work, hold=True, name="spark-driver-1").start()
    await _wait_file(ctx, first, work / "markers-1", f"batch-{HOLD_BATCH}.p*.committed")
    await ctx.fault_now(f"kill -9 of the Spark driver inside micro-batch {HOLD_BATCH}")
    await asyncio.to_thread(first.kill9, group=True)
    recorded = await asyncio.to_thread(_recorded, ctx)
    batch_rows = await asyncio.to_thread(_batch_rows, ctx, HOLD_BATCH)
    parts = len(list((work / "markers-1").glob(f"batch-{HOLD_BATCH}.p*.committed")))
    ctx.note(
        f"at the kill: micro-batch {HOLD_BATCH} had {parts} partition(s) committed, "
        f"{batch_rows} of its rows in the outbox, {recorded} batches recorded"
    )
    ctx.check(
        f"the kill left micro-batch {HOLD_BATCH} half done (rows written, batch not recorded)",
        recorded == HOLD_BATCH and batch_rows > 0,
    )
    second = _driver(ctx, work, hold=False, name="spark-driver-2").start()
    code = await asyncio.to_thread(second.wait, timeout=SPARK_START_TIMEOUT + 120)
    if code is None:
        await asyncio.to_thread(second.kill9, group=True)
        raise ScenarioError("the restarted Spark driver did not finish")
    await asyncio.to_thread(second.kill9, group=True)  # reap; kills what it left behind
    ctx.check("restarted Spark driver finished (exit 0)", code == 0)
    await _account_spark_rows(ctx)


async def _account_spark_rows(ctx: Ctx) -> None:
    """Exactly one outbox row per input row; build the expectations from what is there."""
    rows = await asyncio.to_thread(_sink_rows, ctx)
    per_input: collections.Counter[int] = collections.Counter()
    for _, body in rows:
        per_input[int(body.decode().split()[1])] += 1
    repeated = sum(n - 1 for n in per_input.values() if n > 1)
    missing = [i for i in range(ctx.rows) if i not in per_input]
    ctx.note(
        f"outbox holds {len(rows)} rows for {ctx.rows} input rows; "
        f"{repeated} repeated, {len(missing)} missing"
    )
    ctx.check("no input row written twice", repeated == 0)
    ctx.check(
        f"every micro-batch recorded once ({await asyncio.to_thread(_recorded, ctx)})",
        await asyncio.to_thread(_recorded, ctx) == FILES,
    )
    ctx.result.extra_rows = repeated
    ctx.expect = {m: CONFIRMED for m, _ in rows}
    for i in missing:
        ctx.expect[f"missing-input-row-{i}"] = CONFIRMED
