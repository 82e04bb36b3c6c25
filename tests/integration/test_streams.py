"""Stream destinations against the real broker (rabbitmq_stream): every run reads the whole
stream from its first offset and counts each message id exactly once, none missing, whatever
was killed, frozen or cut on the way (issue 46)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from sqlalchemy import Engine, select, text

from app.db import make_engine
from app.outbox.content import ContentError
from app.outbox.enqueue import enqueue
from app.outbox.message import Message
from app.outbox.schema import outbox, stream_lanes
from app.publisher.metrics import PublisherMetrics, registry_for
from app.publisher.service import run_publisher
from tests.support.env import scrubbed_environ
from tests.support.publisher import FAST, settings_for
from tests.support.streams import delete_stream, new_stream, read_stream

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def stream(stream_url: str) -> Iterator[str]:
    name = new_stream(stream_url)
    yield name
    delete_stream(stream_url, name)


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    eng = make_engine(pg_url)
    yield eng
    eng.dispose()


def _write(engine: Engine, stream: str, ids: range | list[int], *, prefix: str = "m") -> set[str]:
    messages = [Message(stream=stream, body=b"x" * 200, message_id=f"{prefix}{i}") for i in ids]
    with engine.begin() as conn:
        enqueue(conn, messages)
    return {m.message_id for m in messages}


def _statuses(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT status, count(*) FROM outbox GROUP BY 1")).all())


def _env(pg_url: str, amqp_url: str, stream_url: str, **extra: object) -> dict[str, str]:
    env = scrubbed_environ(os.environ)
    settings = {**FAST, "lease_seconds": 2.0, "log_level": "INFO", **extra}
    env.update({f"OUTBOX_{k.upper()}": str(v) for k, v in settings.items()})
    env.update(
        OUTBOX_DATABASE_URL=pg_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_STREAM_URL=stream_url,
        PYTHONPATH=str(REPO),
    )
    return env


def _start(env: dict[str, str], log: Path, *, until_empty: bool = False) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "app.publisher", *(["--until-empty"] if until_empty else [])]
    with log.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def _in_flight(engine: Engine) -> int:
    return _statuses(engine).get("in_flight", 0)


def _confirmed(engine: Engine) -> int:
    return _statuses(engine).get("confirmed", 0)


def _exactly_once(stream_url: str, stream: str, expected: set[str]) -> None:
    got = read_stream(stream_url, stream, expect=len(expected))
    assert got.duplicates() == {}
    assert got.missing(expected) == set()
    assert len(got.ids) == len(expected)


def test_an_applications_rows_reach_the_stream_once_and_are_confirmed(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str
) -> None:
    expected = _write(engine, stream, range(2999))
    expected |= _write(engine, stream, [2999])  # one message: the one-row INSERT names it too
    settings = settings_for(db_url=pg_url, amqp_url=amqp_url, stream_url=stream_url)
    metrics = PublisherMetrics()
    asyncio.run(run_publisher(settings, until_empty=True, metrics=metrics))
    assert _statuses(engine) == {"confirmed": 3000}
    scraped = generate_latest(registry_for(metrics, publisher_id="p")).decode()
    assert 'outbox_publisher_stream_confirmed_total{publisher="p"} 3000.0' in scraped
    assert 'outbox_publisher_stream_published_total{publisher="p"} 3000.0' in scraped
    assert 'outbox_publisher_stream_settled_by_sequence_total{publisher="p"} 0.0' in scraped
    with engine.connect() as conn:
        seqs = conn.execute(select(outbox.c.stream_seq).order_by(outbox.c.id)).scalars().all()
        lane = conn.execute(select(stream_lanes)).one()
    assert seqs == list(range(1, 3001))  # one lane: ids in row order, from 1
    assert lane.next_seq == 3001 and lane.owner is None  # released on the clean stop
    _exactly_once(stream_url, stream, expected)


def test_a_message_names_an_exchange_or_a_stream_and_says_which_is_wrong(engine: Engine) -> None:
    cases = {
        "names no exchange or routing key": Message(
            stream="s", exchange="x", routing_key="k", body=b""
        ),
        "names an exchange and a routing key, or a stream": Message(body=b""),
        "reserved": Message(stream="amq.x", body=b""),
        "ordering_key is for exchanges": Message(stream="s", ordering_key="k", body=b""),
        "at most 255 bytes": Message(stream="s" * 256, body=b""),
    }
    for words, message in cases.items():
        with pytest.raises(ContentError, match=words), engine.begin() as conn:
            enqueue(conn, [message])
    assert _statuses(engine) == {}


def test_bad_rows_fail_alone_and_the_others_go_out(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str
) -> None:
    """Rows a plain-SQL producer wrote wrong: each ends failed with its reason, the others of
    the stream are delivered exactly once, unblocked."""
    good = _write(engine, stream, range(200))
    with engine.begin() as conn:
        conn.execute(
            outbox.insert(),
            [  # every row names every column: executemany takes the first row's keys
                {
                    "message_id": "with-exchange",
                    "batch_id": "b",
                    "exchange": "x",
                    "routing_key": "",
                    "body": b"1",
                    "stream": stream,
                    "headers": None,
                },
                {
                    "message_id": "bad-headers",
                    "batch_id": "b",
                    "exchange": "",
                    "routing_key": "",
                    "body": b"1",
                    "stream": stream,
                    "headers": [1, 2],
                },
                {
                    "message_id": "too-large",
                    "batch_id": "b",
                    "exchange": "",
                    "routing_key": "",
                    "body": b"x" * (2 * 1024 * 1024),
                    "stream": stream,
                    "headers": None,
                },
            ],
        )
    good |= _write(engine, stream, range(200, 400))
    settings = settings_for(
        db_url=pg_url, amqp_url=amqp_url, stream_url=stream_url, max_body_bytes=4 * 1024 * 1024
    )
    asyncio.run(run_publisher(settings, until_empty=True))
    with engine.connect() as conn:
        failed = dict(
            conn.execute(
                select(outbox.c.message_id, outbox.c.last_error).where(outbox.c.status == "failed")
            ).all()
        )
    assert set(failed) == {"with-exchange", "bad-headers", "too-large"}
    assert "names no exchange or routing key" in failed["with-exchange"]
    assert "headers" in failed["bad-headers"]
    assert "frame size" in failed["too-large"]
    assert _statuses(engine) == {"confirmed": 400, "failed": 3}
    _exactly_once(stream_url, stream, good)


def test_rows_for_a_missing_stream_wait_then_fail_with_the_reason(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str
) -> None:
    missing = f"{stream}-missing"
    _write(engine, missing, range(5), prefix="gone")
    good = _write(engine, stream, range(100))
    settings = settings_for(
        db_url=pg_url, amqp_url=amqp_url, stream_url=stream_url, destination_retry_budget=2
    )
    asyncio.run(run_publisher(settings, until_empty=True))
    with engine.connect() as conn:
        reasons = set(
            conn.execute(select(outbox.c.last_error).where(outbox.c.status == "failed")).scalars()
        )
    assert reasons == {f"stream {missing!r} does not exist"}
    assert _statuses(engine) == {"confirmed": 100, "failed": 5}
    _exactly_once(stream_url, stream, good)


def test_kill_9_at_random_points_never_duplicates_nor_loses(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str, tmp_path: Path
) -> None:
    """Ten publishers killed with publishes outstanding, each after a random time; each next
    one takes the lane over once the lease expired, asks the broker its last id, settles what
    the broker has without publishing it, and sends the rest under the same ids."""
    rng = random.Random(int(os.environ.get("OUTBOX_TEST_SEED", "46")))
    env = _env(pg_url, amqp_url, stream_url, claim_batch=100, window=500)
    expected: set[str] = set()
    log = tmp_path / "publishers.log"
    kills = 0
    outstanding: list[int] = []
    for run in range(10):
        expected |= _write(engine, stream, range(run * 1000, (run + 1) * 1000))
        before = _confirmed(engine)
        proc = _start(env, log)
        deadline = time.monotonic() + 60
        target = before + rng.randint(100, 800)
        while _confirmed(engine) < target and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.05))
        while not _in_flight(engine) and time.monotonic() < deadline:  # publishes outstanding
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        kills += 1
        outstanding.append(_in_flight(engine))
    final = _start(env, log, until_empty=True)
    assert final.wait(120) == 0, log.read_text()[-3000:]
    assert _statuses(engine) == {"confirmed": 10000}
    with engine.connect() as conn:
        lane = conn.execute(select(stream_lanes)).one()
    assert lane.takeovers >= kills  # every killed holder's lane was taken over
    text_log = log.read_text()
    assert "taken over" in text_log
    assert sum(1 for n in outstanding if n) >= 5, outstanding  # kills with rows in flight
    _exactly_once(stream_url, stream, expected)


def test_a_frozen_publisher_loses_its_lane_and_writes_nothing_of_it(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str, tmp_path: Path
) -> None:
    """Two publishers: the holder freezes with publishes outstanding (SIGSTOP), the other takes
    the lane over after the lease; the frozen one wakes up, finds the lane gone and writes
    nothing of it. Each message is in the stream once."""
    env = _env(pg_url, amqp_url, stream_url, claim_batch=100, window=400)
    expected = _write(engine, stream, range(12000))
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = _start(env, log_a)
    deadline = time.monotonic() + 60
    while _confirmed(engine) < 1500 and time.monotonic() < deadline:
        time.sleep(0.02)
    a.send_signal(signal.SIGSTOP)
    b = _start(env, log_b)
    try:
        deadline = time.monotonic() + 60
        while _confirmed(engine) < 5000 and time.monotonic() < deadline:
            time.sleep(0.05)
        a.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 90
        while _confirmed(engine) < 12000 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for proc in (a, b):
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert _statuses(engine) == {"confirmed": 12000}
    assert "taken over" in log_b.read_text()
    assert "lost the lane" in log_a.read_text()
    _exactly_once(stream_url, stream, expected)


def test_connection_cuts_mid_drain_never_duplicate(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str
) -> None:
    """The stream connection cut five times while publishes are outstanding (a proxy in
    front of the broker): after each cut the lane asks the broker and sends only what it lacks."""
    from app.streams.endpoint import StreamEndpoint
    from chaos.proxy import TcpProxy

    ep = StreamEndpoint.parse(stream_url)
    expected = _write(engine, stream, range(20000))

    async def scenario() -> None:
        proxy = TcpProxy(ep.host, ep.port)
        port = await proxy.start()
        url = f"rabbitmq-stream://{ep.username}:{ep.password}@127.0.0.1:{port}/"
        settings = settings_for(
            db_url=pg_url, amqp_url=amqp_url, stream_url=url, claim_batch=100, window=500
        )
        task = asyncio.create_task(run_publisher(settings, until_empty=True))
        cuts = 0
        while not task.done() and cuts < 5:
            await asyncio.sleep(0.3)
            if proxy.open_connections():
                proxy.cut()
                cuts += 1
        await asyncio.wait_for(task, 120)
        await proxy.close()
        assert cuts >= 3, (proxy.accepted, proxy.open_connections())

    asyncio.run(scenario())
    assert _statuses(engine) == {"confirmed": 20000}
    _exactly_once(stream_url, stream, expected)


def test_three_lanes_shared_by_two_publishers_each_once(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str
) -> None:
    """Lanes split a stream between publishers: each lane one reference, its own ids."""
    expected = _write(engine, stream, range(6000))

    async def both() -> None:
        runs = [
            run_publisher(
                settings_for(
                    db_url=pg_url,
                    amqp_url=amqp_url,
                    stream_url=stream_url,
                    stream_lanes=3,
                    publisher_id=f"lanes-{n}",
                ),
                until_empty=True,
            )
            for n in range(2)
        ]
        await asyncio.gather(*runs)

    asyncio.run(both())
    assert _statuses(engine) == {"confirmed": 6000}
    with engine.connect() as conn:
        lanes = conn.execute(select(stream_lanes).order_by(stream_lanes.c.lane)).all()
        per_lane = conn.execute(
            text("SELECT id % 3, min(stream_seq), max(stream_seq), count(*) FROM outbox GROUP BY 1")
        ).all()
    assert [lane.lanes for lane in lanes] == [3, 3, 3]
    assert len({lane.reference for lane in lanes}) == 3
    assert sorted((lane, low, high, n) for lane, low, high, n in per_lane) == [
        (0, 1, 2000, 2000),
        (1, 1, 2000, 2000),
        (2, 1, 2000, 2000),
    ]
    _exactly_once(stream_url, stream, expected)


def test_an_operator_moves_a_lane_mid_drain_and_nothing_doubles(
    engine: Engine,
    pg_url: str,
    amqp_url: str,
    stream_url: str,
    stream: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`outbox move-lane` frees a held lane while publishes are outstanding (audited): its
    holder stops writing it, a publisher takes it over from the broker's last stored id."""
    from app.cli import main as cli

    caplog.set_level(logging.INFO, logger="app.streams")
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_url)
    # enough rows left after the move for the holder to see it mid-drain: with 12,000 and the
    # move at 2,000, a CI machine's busy second worker slowed the CLI until the drain was done
    expected = _write(engine, stream, range(20000))
    settings = settings_for(
        db_url=pg_url, amqp_url=amqp_url, stream_url=stream_url, claim_batch=100, window=400
    )

    async def scenario() -> int:
        task = asyncio.create_task(run_publisher(settings, until_empty=True))
        while await asyncio.to_thread(_confirmed, engine) < 1000:
            await asyncio.sleep(0.01)
        rc = await asyncio.to_thread(cli, ["move-lane", stream, "--actor", "on-call"])
        await asyncio.wait_for(task, 120)
        return rc

    assert asyncio.run(scenario()) == 0
    said_cli = capsys.readouterr().out
    assert "freed lane 0 (held by " in said_cli, said_cli
    assert _statuses(engine) == {"confirmed": 20000}
    with engine.connect() as conn:
        audit = conn.execute(
            text("SELECT actor, action, count FROM outbox_audit WHERE action = 'move lane'")
        ).all()
    assert audit == [("on-call", "move lane", 1)], caplog.text
    said = caplog.text
    assert "lost the lane" in said
    # after the move, the lane resumed from the broker's last stored id
    assert said.index("lost the lane") < said.rindex("rows the broker already had settled"), said
    _exactly_once(stream_url, stream, expected)


def test_a_url_naming_a_cluster_finds_a_node_that_answers(
    engine: Engine, pg_url: str, amqp_url: str, stream_url: str, stream: str
) -> None:
    """OUTBOX_STREAM_URL may list a cluster's nodes: a node that refuses connections (here a
    port nobody listens on, first in the list) costs a refused connect, not the rows."""
    import socket

    from app.streams.endpoint import StreamEndpoint

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    ep = StreamEndpoint.parse(stream_url)
    url = f"rabbitmq-stream://{ep.username}:{ep.password}@127.0.0.1:{dead},{ep.host}:{ep.port}/"
    expected = _write(engine, stream, range(2000))
    settings = settings_for(db_url=pg_url, amqp_url=amqp_url, stream_url=url)
    asyncio.run(run_publisher(settings, until_empty=True))
    assert _statuses(engine) == {"confirmed": 2000}
    _exactly_once(stream_url, stream, expected)
