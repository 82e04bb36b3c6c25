"""The API and console tests' shared ground: tokens, a clock, an outbox seeded with every state,
settings and an HTTP client for an app."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import httpx
from pydantic import SecretStr
from sqlalchemy import Engine, func, insert, select

from app.outbox.records import Backoff, ReturnedRow
from app.outbox.schema import audit, batches, outbox, publishers
from app.outbox.states import Status
from app.settings import Settings
from tests.support.clock import T0, Clock
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients

READ = "read-R4vYq7Lm2XcN8Tk5Bw3Zh9Pd6Gs1Jf0"
OPERATOR = "oper-K8nW2xQv5Hc7Ly3Dm9Tb4Rg6Zp1Fs0"
R = {"Authorization": f"Bearer {READ}"}
OP = {"Authorization": f"Bearer {OPERATOR}"}


@dataclass
class Seeded:
    """Message ids by the state the seed left them in."""

    ids: dict[str, list[str]] = field(default_factory=dict)
    lost: str = ""

    def __getitem__(self, key: str) -> list[str]:
        return self.ids[key]


LATENCY_STATS = {
    "published": 120,
    "confirmed": 100,
    "nacked": 4,
    "returned": 2,
    "failed": 2,
    "lost_confirms": 3,
    "channel_closes": 1,
    "reconnects": 1,
    "protocol_errors": 0,
    "blocked_seconds": 1.5,
    "confirm_latency_buckets": {
        "0.005": 10,
        "0.05": 60,
        "0.5": 95,
        "+Inf": 100,
        "sum": 9.5,
        "count": 100,
    },
}


def _published(
    repo: OutboxClients,
    owner: str,
    engine: Engine,
    clock: Clock,
    *,
    n: int,
    batch_id: str,
    channel: int,
    tag0: int,
    exchange: str = "orders",
    publish: bool = True,
    prefix: str | None = None,
) -> list[str]:
    """``n`` new rows claimed by ``owner`` (and published on ``channel`` from ``tag0``)."""
    ids = add_rows(
        engine,
        n=n,
        batch_id=batch_id,
        exchange=exchange,
        prefix=prefix,
        created_at=clock.now,
        available_at=clock.now,
    )
    got = repo.store.claim(owner=owner, limit=n, lease_seconds=600)
    assert len(got) == n
    if publish:
        repo.store.record_published(
            owner=owner, channel_id=channel, tags=[(r.id, tag0 + i) for i, r in enumerate(got)]
        )
    return ids


def _row_ids(engine: Engine, message_ids: list[str]) -> list[int]:
    with engine.connect() as conn:
        stmt = select(outbox.c.id).where(outbox.c.message_id.in_(message_ids))
        return sorted(conn.execute(stmt).scalars())


def seed_every_state(engine: Engine, clock: Clock) -> Seeded:
    """Batch ``orders:1``: confirmed, returned, nacked. Batch ``orders:2``: failed, in flight
    (published and claimed-only), pending (one after a lost confirm). ``orders:3``: recorded by
    Spark with every row rejected. Two publishers: ``p1`` alive with counters, ``p0`` stopped."""
    repo = OutboxClients(engine, clock=clock)
    s = Seeded()
    # "order-1-0" is the OpenAPI example of a message id: the fuzzer finds it
    s.ids["confirmed"] = _published(
        repo, "p1", engine, clock, n=3, batch_id="orders:1", channel=1, tag0=1, prefix="order-1"
    )
    clock.advance(0.25)
    repo.store.mark_confirmed(owner="p1", ids=_row_ids(engine, s["confirmed"]))
    s.ids["returned"] = _published(
        repo, "p1", engine, clock, n=2, batch_id="orders:1", channel=1, tag0=4
    )
    repo.store.mark_returned(
        owner="p1",
        returns=[ReturnedRow(i, 312, "NO_ROUTE") for i in _row_ids(engine, s["returned"])],
    )
    s.ids["nacked"] = _published(
        repo, "p1", engine, clock, n=2, batch_id="orders:1", channel=1, tag0=6, exchange="payments"
    )
    repo.store.retry(
        owner="p1",
        ids=_row_ids(engine, s["nacked"]),
        error="nacked by broker",
        backoff=Backoff(),
        exhausted=Status.NACKED,
        max_attempts=1,
    )
    clock.advance(10)
    s.ids["failed"] = _published(
        repo, "p1", engine, clock, n=2, batch_id="orders:2", channel=2, tag0=1, publish=False
    )
    repo.store.mark_failed(owner="p1", ids=_row_ids(engine, s["failed"]), reason="body too large")
    clock.advance(5)
    s.ids["pending"] = add_rows(
        engine,
        n=1,
        batch_id="orders:2",
        created_at=clock.now,
        available_at=clock.now + dt.timedelta(hours=1),
    )
    s.ids["in_flight"] = []
    for i in range(3):
        clock.advance(1)
        s.ids["in_flight"] += _published(
            repo, "p1", engine, clock, n=1, batch_id="orders:2", channel=3, tag0=10 + i
        )
    s.ids["claimed"] = _published(
        repo, "p2", engine, clock, n=1, batch_id="orders:2", channel=0, tag0=0, publish=False
    )
    # published, then its channel closed before the confirm: pending again, a possible duplicate
    s.lost = _published(repo, "p1", engine, clock, n=1, batch_id="orders:2", channel=2, tag0=1)[0]
    repo.store.release(
        owner="p1", ids=_row_ids(engine, [s.lost]), lost=True, error="channel closed"
    )
    s.ids["pending"].append(s.lost)
    _spark_batches(engine)
    _publishers(engine, clock)
    return s


def _spark_batches(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(batches),
            [
                {
                    "batch_id": "orders:1",
                    "sink": "orders",
                    "spark_batch_id": 1,
                    "query_id": "q",
                    "row_count": 7,
                    "rejected_count": 0,
                    "committed_at": T0,
                },
                {
                    "batch_id": "orders:3",
                    "sink": "orders",
                    "spark_batch_id": 3,
                    "query_id": "q",
                    "row_count": 0,
                    "rejected_count": 5,
                    "committed_at": T0,
                },
            ],
        )


def _publishers(engine: Engine, clock: Clock) -> None:
    old = {
        **LATENCY_STATS,
        "published": 10,
        "confirmed": 10,
        "confirm_latency_buckets": {"0.05": 4, "1.0": 10, "sum": 2.0, "count": 10},
    }
    with engine.begin() as conn:
        conn.execute(
            insert(publishers),
            [
                {
                    "publisher_id": "p1",
                    "hostname": "h1",
                    "pid": 11,
                    "started_at": T0,
                    "heartbeat_at": clock.now,
                    "stopped_at": None,
                    "stats": LATENCY_STATS,
                },
                {
                    "publisher_id": "p0",
                    "hostname": "h0",
                    "pid": 10,
                    "started_at": T0,
                    "heartbeat_at": T0,
                    "stopped_at": T0,
                    "stats": old,
                },
            ],
        )


def settings_for(url: str, **kw: object) -> Settings:
    values: dict[str, object] = {
        "database_url": SecretStr(url),
        "api_token": SecretStr(READ),
        "operator_token": SecretStr(OPERATOR),
        "api_insecure": False,
        "amqp_url": SecretStr("amqp://guest:guest@127.0.0.1:1/"),
        **kw,
    }
    return Settings(**values)  # type: ignore[arg-type]


def client_for(app: object) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://outbox.test")


def statuses_of(engine: Engine, message_ids: list[str]) -> dict[str, str]:
    stmt = select(outbox.c.message_id, outbox.c.status).where(outbox.c.message_id.in_(message_ids))
    with engine.connect() as conn:
        return {m: s for m, s in conn.execute(stmt).all()}


def audit_rows(engine: Engine) -> list[dict[str, object]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(audit).order_by(audit.c.id)).mappings()]


@dataclass
class StreamSeed:
    """Rows for two RabbitMQ streams (``s-a``, ``s-b``; two lanes each), written by
    :func:`app.outbox.enqueue.enqueue` and moved by the stream relay's own store: message ids
    by what became of them."""

    owner: str
    in_flight: list[str] = field(default_factory=list)
    #: in flight again under their publishing ids after a resume (``lost_confirms`` 1 each)
    resent: list[str] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)


STREAM_FAILURE = "stream refused the message: frame too large"


def seed_streams(engine: Engine, clock: Clock, *, owner: str = "p9#stream") -> StreamSeed:
    """``s-a``: 6 rows; lane 0 has one confirmed, one failed and the rest in flight; lane 1 was
    resumed after a lost confirm (its rows in flight again under their ids, one confirmed).
    ``s-b``: 2 rows, failed with the same reason as ``s-a``'s. ``clock`` is moved up to the
    rows' due time if behind it (``enqueue`` makes rows due at the database's ``now()``)."""
    from app.outbox.database import OutboxDatabase
    from app.outbox.enqueue import enqueue
    from app.outbox.message import Message
    from app.streams.store import StreamStore

    store = StreamStore(OutboxDatabase(engine, clock=clock))
    with engine.begin() as conn:
        enqueue(
            conn,
            [Message(stream="s-a", body=b"a%d" % i, message_id=f"sa-{i}") for i in range(6)]
            + [Message(stream="s-b", body=b"b%d" % i, message_id=f"sb-{i}") for i in range(2)],
            source="streams:1",
        )
    with engine.connect() as conn:
        due = select(func.max(outbox.c.available_at)).where(outbox.c.stream.is_not(None))
        clock.now = max(clock.now, conn.execute(due).scalar_one())
    for name in ("s-a", "s-b"):
        store.ensure_lanes(name, 2)
    lanes = store.acquire(owner=owner, streams=["s-a", "s-b"], lease_seconds=60)
    seed = StreamSeed(owner=owner, failed={"s-a": [], "s-b": []})
    for lane in lanes:
        rows = store.claim(owner=owner, lane=lane, limit=10, lease_seconds=60)
        if lane.stream == "s-b":
            store.failed(owner=owner, lane=lane, ids=[r.id for r in rows], reason=STREAM_FAILURE)
            seed.failed["s-b"] += [r.message_id for r in rows]
            continue
        if lane.lane == 1:  # a new session: the broker had none of its ids, all go out again
            rows = store.resume(owner=owner, lane=lane, stored=0, limit=10, lease_seconds=60).again
        first, *rest = rows
        store.confirmed(owner=owner, lane=lane, ids=[first.id], published_at=clock.now)
        seed.confirmed.append(first.message_id)
        if lane.lane == 0:
            last = rest.pop()
            store.failed(owner=owner, lane=lane, ids=[last.id], reason=STREAM_FAILURE)
            seed.failed["s-a"].append(last.message_id)
        seed.in_flight += [r.message_id for r in rest]
        seed.resent += [r.message_id for r in rest] if lane.lane == 1 else []
    return seed
