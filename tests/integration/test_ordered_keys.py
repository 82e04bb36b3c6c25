"""Per-key order: a row of an ordering key is claimed (and so first published) only when every
earlier row of its key is confirmed or skipped; a terminal failure parks its key until an
operator republishes or skips it. Repository rules on PostgreSQL and SQLite, then real-broker
drains checked by a consumer that records the order of first deliveries per key."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid
from collections import defaultdict

import aio_pika
import pytest
from sqlalchemy import Engine, insert, select

from app.db import make_engine
from app.outbox.actions import CannotSkip
from app.outbox.read.keys import parked_keys
from app.outbox.schema import audit, outbox
from app.outbox.scope import RepublishFilter
from tests.support.outbox_clients import OutboxClients
from tests.support.publisher import (
    all_in,
    declare,
    delete,
    rows,
    running_publisher,
    settings_for,
    wait_rows,
)

T0 = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)


def add_keyed(
    engine: Engine,
    *,
    keys: int,
    per_key: int,
    exchange: str = "ex",
    routing_key: str = "rk",
    prefix: str | None = None,
    max_attempts: int = 10,
    interleave: bool = True,
) -> dict[str, list[str]]:
    """``per_key`` rows for each of ``keys`` keys, inserted so ids follow each key's sequence
    (interleaved across keys, like a real stream); returns message ids per key in order."""
    prefix = prefix or uuid.uuid4().hex[:6]
    order = (
        [(k, s) for s in range(per_key) for k in range(keys)]
        if interleave
        else [(k, s) for k in range(keys) for s in range(per_key)]
    )
    by_key: dict[str, list[str]] = defaultdict(list)
    batch = []
    for k, s in order:
        key = f"{prefix}-k{k}"
        mid = f"{key}-{s}"
        by_key[key].append(mid)
        batch.append(
            {
                "message_id": mid,
                "batch_id": "ordered:1",
                "exchange": exchange,
                "routing_key": routing_key,
                "body": mid.encode(),
                "ordering_key": key,
                "max_attempts": max_attempts,
                "available_at": T0,
            }
        )
    with engine.begin() as conn:
        for start in range(0, len(batch), 5000):
            conn.execute(insert(outbox), batch[start : start + 5000])
    return dict(by_key)


def claim_ids(repo: OutboxClients, owner: str = "p1", limit: int = 100) -> list[str]:
    return [r.message_id for r in repo.store.claim(owner=owner, limit=limit, lease_seconds=30)]


def confirm(repo: OutboxClients, engine: Engine, mids: list[str], owner: str = "p1") -> None:
    with engine.connect() as conn:
        ids = conn.execute(select(outbox.c.id).where(outbox.c.message_id.in_(mids))).scalars()
        repo.store.mark_confirmed(owner=owner, ids=list(ids))


def fail(repo: OutboxClients, engine: Engine, mid: str, owner: str = "p1") -> None:
    with engine.connect() as conn:
        row_id = conn.execute(select(outbox.c.id).where(outbox.c.message_id == mid)).scalar_one()
    repo.store.mark_failed(owner=owner, ids=[row_id], reason="exchange 'x' missing (404)")


@pytest.fixture
def repo(engine: Engine) -> OutboxClients:
    return OutboxClients(engine, clock=lambda: T0 + dt.timedelta(seconds=1))


class TestKeyHeads:
    def test_only_each_keys_head_is_claimed_unkeyed_rows_flow(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        keyed = add_keyed(engine, keys=2, per_key=3, prefix="a")
        from tests.support.factories import add_rows

        free = add_rows(engine, n=3, available_at=T0)
        first = claim_ids(repo)
        assert sorted(first) == sorted([keyed["a-k0"][0], keyed["a-k1"][0], *free])
        assert claim_ids(repo) == []  # the heads are in flight: nothing more of their keys
        confirm(repo, engine, [keyed["a-k0"][0]])
        assert claim_ids(repo) == [keyed["a-k0"][1]]  # k1's head still unconfirmed

    def test_a_terminal_failure_parks_its_key_only(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        keyed = add_keyed(engine, keys=2, per_key=3, prefix="b")
        claim_ids(repo)
        fail(repo, engine, keyed["b-k0"][0])
        confirm(repo, engine, [keyed["b-k1"][0]])
        assert claim_ids(repo) == [keyed["b-k1"][1]]  # k1 goes on, k0 is parked
        (parked,) = parked_keys(engine)
        assert parked.ordering_key == "b-k0" and parked.blocking_message_id == "b-k0-0"
        assert parked.blocking_status == "failed" and parked.waiting == 2
        assert "404" in (parked.blocking_error or "")

    def test_republish_puts_the_blocking_row_first_and_the_key_resumes(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        keyed = add_keyed(engine, keys=1, per_key=3, prefix="c")
        claim_ids(repo)
        fail(repo, engine, "c-k0-0")
        result = repo.actions.republish(
            actor="ops", filter=RepublishFilter(ordering_key="c-k0"), limit=10, dry_run=False
        )
        assert result.count == 1 and result.sample == ["c-k0-0"]
        assert parked_keys(engine) == []
        for expected in keyed["c-k0"]:
            assert claim_ids(repo) == [expected]
            confirm(repo, engine, [expected])
        assert claim_ids(repo) == []

    def test_skip_releases_the_key_and_is_audited(
        self, repo: OutboxClients, engine: Engine
    ) -> None:
        add_keyed(engine, keys=1, per_key=3, prefix="d")
        claim_ids(repo)
        with pytest.raises(CannotSkip, match="in_flight"):
            repo.actions.skip(actor="ops", message_id="d-k0-0", reason="bad payload")
        fail(repo, engine, "d-k0-0")
        with pytest.raises(CannotSkip, match="reason"):
            repo.actions.skip(actor="ops", message_id="d-k0-0", reason="  ")
        with pytest.raises(CannotSkip, match="no row"):
            repo.actions.skip(actor="ops", message_id="nope", reason="x")
        result = repo.actions.skip(
            actor="ops", message_id="d-k0-0", reason="payload rejected by team"
        )
        assert result.released == 2 and result.previous == "failed"
        assert claim_ids(repo) == ["d-k0-1"]
        with engine.connect() as conn:
            row = conn.execute(select(audit).where(audit.c.id == result.audit_id)).mappings().one()
            status = conn.execute(
                select(outbox.c.status).where(outbox.c.message_id == "d-k0-0")
            ).scalar_one()
        assert row["action"] == "skip" and row["actor"] == "ops"
        assert row["filter"]["reason"] == "payload rejected by team"
        assert status == "skipped"

    def test_a_key_in_backoff_holds_only_itself(self, engine: Engine, repo: OutboxClients) -> None:
        """A nacked head goes back to pending with a delay: its key waits, others go on."""
        from app.outbox.records import Backoff
        from app.outbox.states import Status

        keyed = add_keyed(engine, keys=2, per_key=2, prefix="e")
        claim_ids(repo)
        with engine.connect() as conn:
            head = conn.execute(
                select(outbox.c.id).where(outbox.c.message_id == "e-k0-0")
            ).scalar_one()
        repo.store.retry(
            owner="p1",
            ids=[head],
            error="nacked",
            backoff=Backoff(base=60, cap=60),
            exhausted=Status.NACKED,
        )
        confirm(repo, engine, [keyed["e-k1"][0]])
        assert claim_ids(repo) == ["e-k1-1"]


def test_concurrent_claimers_never_hold_two_rows_of_a_key(pg_url: str) -> None:
    """Two claimers on PostgreSQL, each claiming and confirming as fast as it can: at no time
    are two rows of a key in flight, and each key is confirmed in its order."""
    engine = make_engine(pg_url)
    keyed = add_keyed(engine, keys=40, per_key=15, prefix="f")
    confirmed: list[tuple[float, str]] = []
    lock = threading.Lock()
    errors: list[str] = []

    def claimer(owner: str) -> None:
        repo = OutboxClients(make_engine(pg_url))
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 1.5:
            got = repo.store.claim(owner=owner, limit=25, lease_seconds=30)
            if not got:
                time.sleep(0.01)
                continue
            idle_since = time.monotonic()
            keys = [r.ordering_key for r in got]
            if len(keys) != len(set(keys)):
                errors.append(f"{owner} got two rows of a key in one claim: {keys}")
            repo.store.mark_confirmed(owner=owner, ids=[r.id for r in got])
            with lock:
                confirmed.extend((time.monotonic(), r.message_id) for r in got)
        repo.db.engine.dispose()

    try:
        threads = [threading.Thread(target=claimer, args=(o,)) for o in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors
        assert len(confirmed) == 40 * 15
        order: dict[str, list[str]] = defaultdict(list)
        for _, mid in sorted(confirmed):
            order[mid.rsplit("-", 1)[0]].append(mid)
        assert order == keyed
    finally:
        engine.dispose()


# ------------------------------------------------------------------------- real broker


async def first_deliveries(amqp_url: str, queue: str, *, expect: int) -> list[str]:
    """Every message of ``queue`` in arrival order (auto-ack), until ``expect`` distinct ids
    came and nothing more arrived for a second."""
    got: list[str] = []
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        q = await ch.get_queue(queue, ensure=False)
        last = time.monotonic()
        deadline = last + 90
        while time.monotonic() < deadline:
            msg = await q.get(no_ack=True, fail=False)
            if msg is None:
                if len(set(got)) >= expect and time.monotonic() - last > 1.0:
                    break
                await asyncio.sleep(0.02)
                continue
            got.append(msg.message_id or "")
            last = time.monotonic()
    return got


def assert_key_order(arrivals: list[str], keyed: dict[str, list[str]]) -> None:
    firsts: dict[str, list[str]] = defaultdict(list)
    seen: set[str] = set()
    for mid in arrivals:
        if mid not in seen:
            seen.add(mid)
            firsts[mid.rsplit("-", 1)[0]].append(mid)
    assert dict(firsts) == keyed


async def test_two_publishers_keep_every_keys_order(pg_url: str, amqp_url: str) -> None:
    exchange = queue = f"test-ordered-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=exchange, queue=queue)
    engine = make_engine(pg_url)
    try:
        keyed = add_keyed(engine, keys=30, per_key=20, exchange=exchange)
        a = settings_for(db_url=pg_url, amqp_url=amqp_url, publisher_id="ord-a", channels=2)
        b = settings_for(db_url=pg_url, amqp_url=amqp_url, publisher_id="ord-b", channels=2)
        async with running_publisher(a, engine), running_publisher(b, engine):
            await wait_rows(engine, all_in("confirmed"), timeout=90)
        arrivals = await first_deliveries(amqp_url, queue, expect=600)
        assert_key_order(arrivals, keyed)
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(queue,))


async def test_nacks_never_let_a_later_row_overtake(pg_url: str, amqp_url: str) -> None:
    """A queue at its length limit nacks (reject-publish): nacked rows go back with backoff,
    their keys wait; a consumer drains slowly and sees every key in order."""
    exchange = queue = f"test-ordered-nack-{uuid.uuid4().hex[:8]}"
    limited = {"x-max-length": 15, "x-overflow": "reject-publish"}
    await declare(amqp_url, exchange=exchange, queue=queue, arguments=limited)
    engine = make_engine(pg_url)
    try:
        keyed = add_keyed(engine, keys=10, per_key=8, exchange=exchange, max_attempts=1000)
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url, backoff_max=0.1)
        async with running_publisher(settings, engine) as publisher:
            deadline = time.monotonic() + 30
            while publisher.metrics.nacked == 0:  # the queue fills up first: real broker nacks
                assert time.monotonic() < deadline, "the broker never nacked"
                await asyncio.sleep(0.02)
            arrivals = await first_deliveries(amqp_url, queue, expect=80)
            await wait_rows(engine, all_in("confirmed"))
        assert_key_order(arrivals, keyed)
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(queue,))


async def test_a_returned_row_parks_its_key_until_skipped(pg_url: str, amqp_url: str) -> None:
    """An unroutable row ends returned: its key's later rows wait (parked), other keys flow;
    skipping it releases the key, which then drains in order."""
    exchange = queue = f"test-ordered-ret-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=exchange, queue=queue)
    engine = make_engine(pg_url)
    try:
        keyed = add_keyed(engine, keys=3, per_key=4, exchange=exchange)
        with engine.begin() as conn:  # the second row of k0 goes nowhere: returned 312
            conn.execute(
                outbox.update()
                .where(outbox.c.message_id == keyed[_key(keyed, 0)][1])
                .values(routing_key="nowhere")
            )
        k0 = _key(keyed, 0)
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url)
        async with running_publisher(settings, engine):
            await wait_rows(
                engine, lambda rs: sum(r.status == "confirmed" for r in rs) == 9, timeout=30
            )
            await asyncio.sleep(0.5)  # the waiting rows of k0 stay pending
            (parked,) = parked_keys(engine)
            assert parked.ordering_key == k0 and parked.waiting == 2
            assert parked.blocking_status == "returned" and parked.blocking_reply_code == 312
            OutboxClients(engine).actions.skip(
                actor="test", message_id=keyed[k0][1], reason="no route"
            )
            await wait_rows(engine, all_in("confirmed", "skipped"))
        arrivals = await first_deliveries(amqp_url, queue, expect=11)
        expected = {k: [m for m in v if m != keyed[k0][1]] for k, v in keyed.items()}
        assert_key_order(arrivals, expected)
        assert {r.message_id: r.status for r in rows(engine)}[keyed[k0][1]] == "skipped"
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(queue,))


def _key(keyed: dict[str, list[str]], n: int) -> str:
    return sorted(keyed)[n]


# ------------------------------------------------------------------------ operators


async def test_parked_keys_and_skip_over_rest(db_url: str, engine: Engine) -> None:
    from app.api.app import create_app
    from tests.support.api import OP, R, client_for
    from tests.support.api import settings_for as api_settings

    repo = OutboxClients(engine, clock=lambda: T0 + dt.timedelta(seconds=1))
    add_keyed(engine, keys=2, per_key=3, prefix="g")
    claim_ids(repo)
    fail(repo, engine, "g-k1-0")
    async with client_for(create_app(api_settings(db_url), engine=engine)) as c:
        r = await c.get("/v1/keys/parked", headers=R)
        assert r.status_code == 200, r.text
        (item,) = r.json()["items"]
        assert item["ordering_key"] == "g-k1" and item["blocking_message_id"] == "g-k1-0"
        assert item["waiting"] == 2 and item["blocking_status"] == "failed"
        body = {"reason": "bad payload, confirmed with the team"}
        r = await c.post("/v1/messages/g-k1-0/skip", json=body, headers=R)
        assert r.status_code == 403, r.text  # a read token cannot act
        r = await c.post("/v1/messages/g-k0-0/skip", json=body, headers=OP)
        assert r.status_code == 409 and "in_flight" in r.text  # not a terminal failure
        r = await c.post("/v1/messages/nope/skip", json=body, headers=OP)
        assert r.status_code == 404
        r = await c.post("/v1/messages/g-k1-0/skip", json={"reason": ""}, headers=OP)
        assert r.status_code == 422
        # A reason is untrusted text: NUL (PostgreSQL's text refuses it) and other control
        # characters (they would forge lines in logs and tables) are refused with the field
        # named; a lone surrogate (not UTF-8) is refused with the body; the row waits, untouched.
        for bad, status, why in (
            (r"bad\u0000payload", 422, "reason"),
            (r"line one\nline two", 422, "reason"),
            (r"\u001b[31mred", 422, "reason"),
            # issue 29: C1 (NEL split a JSON log line), U+2028/9, bidi
            (r"NEL\u0085split", 422, "reason"),
            (r"csi\u009b2J", 422, "reason"),
            (r"line\u2028separator", 422, "reason"),
            (r"invoice\u202efdp.exe", 422, "reason"),
            (r"isolate\u2067x\u2069", 422, "reason"),
            (r"\ud800", 400, "lone surrogate"),
        ):
            raw = f'{{"reason": "{bad}"}}'.encode()  # as a client may send it
            r = await c.post(
                "/v1/messages/g-k1-0/skip",
                content=raw,
                headers={**OP, "Content-Type": "application/json"},
            )
            assert r.status_code == status and why in r.text, (bad, r.text)
        r = await c.get("/v1/keys/parked", headers=R)
        assert [k["blocking_message_id"] for k in r.json()["items"]] == ["g-k1-0"]
        r = await c.post("/v1/messages/g-k1-0/skip", json=body, headers=OP)
        assert r.status_code == 200, r.text
        assert r.json()["released"] == 2 and r.json()["previous_status"] == "failed"
        r = await c.get("/v1/keys/parked", headers=R)
        assert r.json()["items"] == []
    assert "g-k1-1" in claim_ids(repo)


def test_parked_and_skip_from_the_cli(
    db_url: str,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from app.cli import main

    monkeypatch.setenv("OUTBOX_DATABASE_URL", db_url)
    repo = OutboxClients(engine)  # real time: the CLI's republish makes rows due now
    add_keyed(engine, keys=1, per_key=2, prefix="h")
    claim_ids(repo)
    fail(repo, engine, "h-k0-0")
    assert main(["parked"]) == 0
    out = capsys.readouterr().out
    assert "h-k0" in out and "h-k0-0" in out and "failed" in out
    assert main(["skip", "h-k0-1", "--reason", "x"]) != 0  # pending, not a terminal failure
    assert "only a terminal failure" in capsys.readouterr().err
    assert main(["republish", "--ordering-key", "h-k0"]) == 0
    capsys.readouterr()
    assert claim_ids(repo) == ["h-k0-0"]
    fail(repo, engine, "h-k0-0")
    assert main(["skip", "h-k0-0", "--reason", "won't fix"]) == 0
    assert "1 waiting rows released" in capsys.readouterr().out
    assert main(["parked"]) == 0 and "no parked keys" in capsys.readouterr().out


async def test_connections_closed_mid_window_never_let_a_later_row_overtake(
    pg_url: str, amqp_url: str
) -> None:
    """The broker closes the publisher's connection (its channels with it) twice while keys are
    in flight: the unconfirmed heads go out again on a fresh connection, still first."""
    from tests.support.env import close_broker_connections

    exchange = queue = f"test-ordered-close-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=exchange, queue=queue)
    engine = make_engine(pg_url)
    try:
        keyed = add_keyed(engine, keys=50, per_key=40, exchange=exchange)
        publisher_id = f"ordered-close-{uuid.uuid4().hex[:6]}"
        settings = settings_for(
            db_url=pg_url, amqp_url=amqp_url, channels=2, publisher_id=publisher_id
        )
        async with running_publisher(settings, engine) as publisher:
            for n in (300, 1000):
                await wait_rows(
                    engine,
                    lambda rs, n=n: sum(r.status == "confirmed" for r in rs) >= n,
                    timeout=60,
                )
                # >= 1: the connection closed at 300 may still be listed while it closes
                closed = await asyncio.to_thread(close_broker_connections, publisher_id)
                assert closed >= 1
            await wait_rows(engine, all_in("confirmed"), timeout=90)
        assert publisher.metrics.reconnects >= 1
        arrivals = await first_deliveries(amqp_url, queue, expect=2000)
        assert_key_order(arrivals, keyed)
    finally:
        engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(queue,))
