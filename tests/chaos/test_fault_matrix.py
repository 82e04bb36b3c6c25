"""The fault matrix's harness inside ``make test``; the matrix itself runs in ``make chaos``.

No scenario of the matrix runs here: ``make chaos`` runs every one, with 10k rows, once per CI
run (they ran here too, at 2k rows, until a CI run took an hour). What ``make test`` keeps is
what proves the harness: the selection of scenarios, and controls through the whole machinery
(private servers, publisher process, verifier, accounting) that must come out ok when nothing
is wrong and fail when a message is lost or a duplicate goes uncounted.

They run against a RabbitMQ and a PostgreSQL of their own (free ports picked at start, data in
.local/chaos-test/<port>, removed at the end; logs kept in .local/chaos-test/logs), never the
shared services other tests use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from pamqp.commands import Basic

from chaos import amqp, lanes, procs
from chaos.matrix import SCENARIOS
from chaos.run import _select, table
from chaos.runner import Ctx, MatrixEnv, Result, Scenario, Step, run_scenario
from chaos.services import REPO, PrivateServices
from chaos.verifier import Verifier

pytestmark = pytest.mark.chaos

RESULTS: list[Result] = []


@pytest.fixture(scope="module")
def matrix() -> Iterator[MatrixEnv]:
    services = PrivateServices.for_tests()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = MatrixEnv.open(services, log_dir=REPO / ".local" / "chaos-test" / "logs" / stamp)
    try:
        yield env
    finally:
        procs.kill_all()
        env.close(stop_services=True)
        services.remove_data()
        if RESULTS:
            print("\n" + table(RESULTS))


def test_long_faults_run_only_in_chaos_long() -> None:
    """``make chaos`` and ``make test`` leave out the faults that last minutes; ``--long`` runs
    those alone, and ``--only`` can still name one."""
    long = {s.key for s in SCENARIOS if s.long}
    assert long
    assert not long & set(_select(None, None))
    assert set(_select(None, None)) | long == {s.key for s in SCENARIOS}
    assert set(_select(None, None, long=True)) == long
    assert _select("17c-long", None) == ["17c-long"]


def test_lanes_run_every_scenario_once_with_fixed_port_servers_in_one_lane() -> None:
    """``make chaos --lanes 2``: each selected scenario in exactly one lane; the three-node
    cluster's and the network namespaces' scenarios all in lane 0, the Patroni pair's all in
    lane 1 (those servers have fixed ports); each lane's own servers on ports of its own."""
    keys = _select(None, None)
    for n in (1, 2, 3):
        plan = lanes.assign(keys, n)
        assert sorted(k for lane in plan for k in lane) == sorted(keys)
        for lane in plan:  # the matrix's order within a lane
            assert lane == [k for k in keys if k in lane]
    plan = lanes.assign(keys, 2)
    where = {k: i for i, lane in enumerate(plan) for k in lane}
    cluster = [s.key for s in SCENARIOS if s.key in where and s.cluster]
    netns = [
        s.key for s in SCENARIOS if s.key in where and s.inject.__module__ == "chaos.partition"
    ]
    pair = [
        s.key for s in SCENARIOS if s.key in where and s.inject.__module__ == "chaos.pg_failover"
    ]
    assert cluster and netns and pair
    assert {where[k] for k in cluster + netns} == {0}
    assert {where[k] for k in pair} == {1}
    assert all(plan), "no lane left idle"
    ports = [PrivateServices.for_matrix(lane=i) for i in range(3)]
    assert len({(p.amqp_port, p.pg_port, p.local_dir) for p in ports}) == 3
    # a lane's child runs its scenarios, each as often as asked (--repeat hunts a flaky one)
    argv = lanes.child_argv("1/2", ["3b", "4"], rows=2000, repeat=5, keep_services=False, out=REPO)
    assert argv[argv.index("--only") + 1] == "3b,4" and argv[argv.index("--repeat") + 1] == "5"
    assert lanes.lane_of("1/2") == (1, 2)
    for bad in ("2/2", "x", "1"):
        with pytest.raises(SystemExit, match="--lane"):
            lanes.lane_of(bad)


# ---------------------------------------------------------------- the harness can pass and fail


async def _purge_queue(ctx: Ctx) -> None:
    """Control: the verifier steps away, the queue is purged, the verifier comes back."""
    assert ctx.verifier is not None
    await ctx.verifier.stop()
    await ctx.fault_now("queue.purge while the verifier is away")
    await asyncio.sleep(0.5)
    async with amqp.channel(ctx.amqp_url) as ch:
        purged = await ch.queue_purge(ctx.names["queue"])
    ctx.note(f"purged {purged.message_count} messages")
    ctx.verifier = Verifier(
        amqp_url=ctx.amqp_url,
        db_url=ctx.env.verifier_db_url,
        run=ctx.run,
        queues=(ctx.names["queue"],),
    )
    await ctx.verifier.start()
    await ctx.landed()


async def _inject_copies(ctx: Ctx) -> None:
    """Control: copies of 5 confirmed rows published again by someone else (a new attempt)."""
    await ctx.fault_now("5 foreign copies of confirmed rows")
    async with amqp.channel(ctx.amqp_url) as ch:
        for i in range(5):
            props = Basic.Properties(
                message_id=f"{ctx.run}-{i:06d}", headers={"x-outbox-attempt": 99}
            )
            await ch.basic_publish(
                b"copy", exchange=ctx.names["exchange"], routing_key="rk", properties=props
            )
    await ctx.landed()


async def _nothing(ctx: Ctx) -> None:
    """Control: no fault at all (the moment is marked, rows are still flowing)."""
    await ctx.fault_now("no fault")


async def test_a_run_without_a_fault_is_ok(matrix: MatrixEnv) -> None:
    """Positive control: a harness that cannot pass proves nothing either."""
    control = Scenario(
        "control", "control: no fault", "every row confirmed and received once", _nothing
    )
    result = await run_scenario(matrix, control, rows=500)
    RESULTS.append(result)
    assert result.error is None, result.explain()
    assert result.confirmed == 500 and result.lost == 0 and result.duplicates == 0
    assert result.ok, result.explain()


@pytest.mark.parametrize(
    ("inject", "flaw"),
    [(_purge_queue, "lost"), (_inject_copies, "uncounted duplicates")],
    ids=["lost", "duplicates"],
)
async def test_the_accounting_catches(matrix: MatrixEnv, inject: Step, flaw: str) -> None:
    """Negative controls: a harness that cannot fail proves nothing."""
    control = Scenario(
        "control",
        f"control: {flaw}",
        "the accounting sees it",
        inject,
        trigger=0.5,
        flow=1.0,
        settle_timeout=5,
    )
    result = await run_scenario(matrix, control, rows=500)
    RESULTS.append(result)
    assert result.error is None, result.explain()
    assert not result.ok, result.explain()
    if flaw == "lost":
        assert result.lost > 0, result.explain()
    else:
        assert result.duplicates == 5 > result.product_dups, result.explain()
