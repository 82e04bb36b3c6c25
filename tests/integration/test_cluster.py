"""Quorum queues on the three-node cluster: ``outbox declare --queue-type quorum``, and the
consumer kit honouring the broker's ``x-delivery-count`` beside its own attempts table."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import uuid
from collections.abc import Iterator
from typing import Any

import aio_pika
import pytest
from sqlalchemy import Engine

from app.amqp.connection import AMQPConnection
from app.consumer import Consumer, ConsumerConfig
from app.db import make_engine
from app.topology import _Quiet as Quiet
from app.topology import declare, queue_arguments
from tests.support.cluster import Cluster
from tests.support.consumer import create_effects, effects, publish, record, until
from tests.support.factories import add_rows
from tests.support.publisher import all_in, running_publisher, settings_for, wait_rows


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    eng = make_engine(pg_url)
    create_effects(eng)
    yield eng
    eng.dispose()


def queue_info(cluster: Cluster, name: str) -> dict[str, Any]:
    out = cluster.run(
        "ctl", "1", "list_queues", "name", "type", "arguments", "leader", "--formatter", "json"
    )
    found = [q for q in json.loads(out) if q["name"] == name]
    assert found, f"queue {name} not on the cluster"
    info = dict(found[0])
    args = info["arguments"]  # rabbitmqctl's JSON: a list of [name, type, value]
    info["arguments"] = {a[0]: a[-1] for a in args} if isinstance(args, list) else args
    return info


async def delete_queues(url: str, *names: str) -> None:
    conn = await aio_pika.connect(url)
    async with conn:
        for name in names:
            ch = await conn.channel()
            with contextlib.suppress(aio_pika.exceptions.ChannelClosed):
                await ch.queue_delete(name)


def test_queue_arguments_refuse_a_delivery_limit_on_a_classic_queue() -> None:
    assert queue_arguments("quorum", delivery_limit=20) == {
        "x-queue-type": "quorum",
        "x-delivery-limit": 20,
    }
    with pytest.raises(ValueError, match="quorum"):
        queue_arguments("classic", delivery_limit=20)
    with pytest.raises(ValueError, match="queue type"):
        queue_arguments("stream")


async def test_declare_makes_a_replicated_quorum_queue_with_its_delivery_limit(
    cluster: Cluster,
) -> None:
    name = f"test-cluster-{uuid.uuid4().hex[:8]}"
    done = await declare(
        cluster.url,
        exchange=name,
        kind="direct",
        queue=name,
        queue_type="quorum",
        delivery_limit=100,
    )
    try:
        assert (done.queue_type, done.delivery_limit) == ("quorum", 100)
        info = queue_info(cluster, name)
        assert info["type"] == "quorum"
        assert info["arguments"]["x-delivery-limit"] == 100
        assert info["leader"].startswith("outbox-c")
        # the same again changes nothing; through another node of the cluster
        again = await declare(
            cluster.node_url(3),
            exchange=name,
            kind="direct",
            queue=name,
            queue_type="quorum",
            delivery_limit=100,
        )
        assert again.queue_type == "quorum"
    finally:
        await delete_queues(cluster.node_url(1), name)


async def _return_times(url: str, queue: str, times: int) -> None:
    """Take the queue's message and give it back ``times`` times (nack, requeue): a quorum
    queue counts each in ``x-delivery-count``, our attempts table sees none."""
    conn = await aio_pika.connect(url)
    async with conn:
        ch = await conn.channel()
        q = await ch.declare_queue(queue, passive=True)
        for _ in range(times):
            got = None
            while got is None:
                got = await q.get(fail=False)
                await asyncio.sleep(0 if got else 0.05)
            await got.nack(requeue=True)


async def test_the_kit_dead_letters_what_the_broker_returned_past_its_broker_limit(
    cluster: Cluster, engine: Engine
) -> None:
    """Another consumer (here: a raw client) had the message back 4 times: the kit's own table
    knows nothing of it, the queue's x-delivery-count does. With broker_delivery_limit 4 the
    kit dead-letters it with its headers, its handler never runs; a fresh message with the
    same handler runs once."""
    url = cluster.node_url(2)  # aio-pika takes one host; the queue's leader may be elsewhere
    name = f"test-cluster-kit-{uuid.uuid4().hex[:8]}"
    await declare(
        url,
        exchange=name,
        kind="direct",
        queue=name,
        queue_type="quorum",
        delivery_limit=100,
        bindings=[name],
    )
    conn = await aio_pika.connect(url)
    async with conn:
        await (await conn.channel()).declare_queue(f"{name}.dlq", durable=True)
    try:
        await publish(url, name, ["returned-4"])
        await _return_times(url, name, 4)
        await publish(url, name, ["fresh-1"])
        cfg = ConsumerConfig(
            name="cluster",
            queue=name,
            delivery_limit=3,
            broker_delivery_limit=4,
            dead_letter_exchange="",
            dead_letter_routing_key=f"{name}.dlq",
        )
        consumer = Consumer(config=cfg, amqp_url=url, engine=engine, handler=record)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        try:
            counts = consumer.metrics.counts
            await until(
                lambda: counts["dead_lettered"] == 1 and "fresh-1" in effects(engine),
                what="the letter and the effect",
            )
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        assert effects(engine) == ["fresh-1"]
        assert consumer.metrics.counts["broker_limited"] == 1
        conn = await aio_pika.connect(url)
        async with conn:
            q = await (await conn.channel()).declare_queue(f"{name}.dlq", passive=True)
            letter = await q.get(no_ack=True)
        assert letter.message_id == "returned-4"
        reason = str((letter.headers or {})["x-outbox-dead-letter-reason"])
        assert "broker delivery limit 4 reached" in reason and "4 times" in reason, reason
    finally:
        await delete_queues(cluster.node_url(1), name, f"{name}.dlq")


# ---------------------------------------------------------------- publishers spread over nodes


async def test_a_multi_host_url_is_tried_in_a_shuffled_order(cluster: Cluster) -> None:
    """Twelve connections through the three-host URL, one seeded order: every node gets some
    (in URL order all twelve went to the first)."""
    rng = random.Random(7)
    nodes = collections.Counter()
    for _ in range(12):
        conn = await AMQPConnection.connect(
            cluster.url, listener=Quiet(), shuffle=rng, name="test-cluster-shuffle"
        )
        assert conn.address is not None
        nodes[cluster.node_of_port(conn.address[1])] += 1
        await conn.close()
    assert set(nodes) == {1, 2, 3}, nodes


async def test_two_publishers_start_on_different_nodes_and_move_on_failover(
    cluster: Cluster, pg_url: str
) -> None:
    """Two publishers with the same three-host URL (seeded: 3 and 4 draw different first
    nodes) drain a quorum queue from two nodes; kill -9 of the first one's node moves it to
    another, every row confirmed; the node back, it takes connections again."""
    name = f"test-cluster-spread-{uuid.uuid4().hex[:8]}"
    await declare(
        cluster.url, exchange=name, kind="direct", queue=name, queue_type="quorum", bindings=["rk"]
    )
    engine = make_engine(pg_url)
    add_rows(engine, n=3000, exchange=name, routing_key="rk")
    settings = settings_for(db_url=pg_url, amqp_url=cluster.url, heartbeat=2)
    killed = None
    try:
        async with (
            running_publisher(settings, engine, rng=random.Random(3)) as a,
            running_publisher(settings, engine, rng=random.Random(4)) as b,
        ):
            await until(
                lambda: a.metrics.broker_node and b.metrics.broker_node, what="both connected"
            )
            first = {a.metrics.broker_node, b.metrics.broker_node}
            assert len(first) == 2, first
            assert a.metrics.broker_node is not None
            killed = cluster.node_of_port(int(a.metrics.broker_node.rsplit(":", 1)[1]))
            cluster.kill(killed)
            await until(lambda: a.metrics.reconnects >= 1, what="publisher a reconnected")
            assert a.metrics.broker_node != f"127.0.0.1:{cluster.port(killed)}"
            final = await wait_rows(engine, all_in("confirmed"), timeout=120)
        assert len(final) == 3000
    finally:
        engine.dispose()
        if killed is not None:
            cluster.start_node(killed)
        await delete_queues(cluster.node_url(2), name)
