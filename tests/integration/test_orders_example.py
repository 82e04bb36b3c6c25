"""The FastAPI examples of docs/examples/, run as documented: an order and its event commit
together (the real publisher delivers the event to a real broker), an order the database refuses
leaves no message, and a retried request leaves one message. The sync example runs in process;
the async one (``orders_service_async.py``, issue 48) under a real uvicorn, as its docstring
says to run it."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType

import aio_pika
import httpx
import pytest
from sqlalchemy import select

from app.db import make_engine
from app.outbox.schema import outbox
from app.tracing import checked_headers
from tests.support.env import REPO
from tests.support.publisher import declare, delete, run_until_empty, settings_for
from tests.support.serve import Served, free_port

EXAMPLE = REPO / "docs" / "examples" / "orders_service.py"
ASYNC_EXAMPLE = REPO / "docs" / "examples" / "orders_service_async.py"


def load_example(path: Path = EXAMPLE) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def orders_topology(amqp_url: str) -> AsyncIterator[dict[str, str]]:
    names = {"exchange": f"test-orders-{uuid.uuid4().hex[:8]}"}
    names["queue"] = names["exchange"] + "-q"
    await declare(
        amqp_url, exchange=names["exchange"], queue=names["queue"], routing_key="order.created"
    )
    yield names
    await delete(amqp_url, exchanges=(names["exchange"],), queues=(names["queue"],))


@asynccontextmanager
async def orders_service(
    kind: str, *, db_url: str, exchange: str
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the example: the sync one in process, the async one under uvicorn with the
    command of its docstring."""
    if kind == "sync":
        app = load_example().create_app(database_url=db_url, exchange=exchange)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://orders.test") as c:
                yield c
        finally:
            app.state.engine.dispose()
        return
    port = free_port()
    command = ["uvicorn", "--factory", "docs.examples.orders_service_async:app_from_env"]
    served = Served(
        [*command, "--port", str(port), "--log-level", "warning"],
        env={"ORDERS_DATABASE_URL": db_url, "ORDERS_EXCHANGE": exchange},
        port=port,
        ready=lambda base: httpx.get(f"{base}/openapi.json", timeout=1).status_code == 200,
    )
    with served:
        async with httpx.AsyncClient(base_url=served.base, timeout=30) as c:
            yield c


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_an_order_and_its_event_commit_together_or_not_at_all(
    pg_url: str, amqp_url: str, orders_topology: dict[str, str], kind: str
) -> None:
    service = load_example()
    exchange = orders_topology["exchange"]
    async with orders_service(kind, db_url=pg_url, exchange=exchange) as client:

        async def post(order_id: str, quantity: int) -> tuple[int, dict[str, object]]:
            r = await client.post(
                "/orders", json={"order_id": order_id, "item": "book", "quantity": quantity}
            )
            return r.status_code, r.json()

        created = await post("o-1", 2)
        refused = await post("o-2", 0)  # the table's CHECK refuses it
        retried = await post("o-1", 2)  # a client retry after a timeout
        changed = await post("o-1", 5)  # the same order id, other content
    assert created == (
        201,
        {"order_id": "o-1", "event_message_id": "order-o-1-created", "duplicate": False},
    )
    assert refused[0] == 422
    assert retried[0] == 201 and retried[1]["duplicate"] is True
    assert changed[0] == 409 and "order-o-1-created" in str(changed[1]["detail"])
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            ids = conn.execute(select(outbox.c.message_id)).scalars().all()
            orders = conn.execute(select(service.orders.c.order_id)).scalars().all()
        assert ids == ["order-o-1-created"] and orders == ["o-1"]
        settings = settings_for(db_url=pg_url, amqp_url=amqp_url)
        stats = await run_until_empty(settings, engine)
        assert stats.confirmed == 1
    finally:
        engine.dispose()
    conn = await aio_pika.connect(amqp_url)
    async with conn:
        queue = await (await conn.channel()).get_queue(orders_topology["queue"], ensure=False)
        got = await queue.get(timeout=10)
        await got.ack()
        assert got.message_id == "order-o-1-created" and got.type == "order.created"
        assert json.loads(got.body) == {"order_id": "o-1", "item": "book", "quantity": 2}
        await asyncio.sleep(0.5)
        assert await queue.get(fail=False) is None  # one message: no refused, no retried one


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_bad_client_input_is_a_4xx_and_a_bad_trace_header_is_ignored(
    pg_url: str, kind: str
) -> None:
    """Issue 48: an order id no message id can carry (a NUL; 98 three-byte characters make a
    294-byte id) escaped the example as InvalidMessage, a 500; a client's malformed
    ``traceparent`` header, passed on as the docs suggest, was a 500 too. Now a 422 naming the
    problem, and a new trace; nothing is written for the refused orders."""
    async with orders_service(kind, db_url=pg_url, exchange="orders-example") as client:
        for bad in ("nul\x00id", "€" * 98):
            r = await client.post("/orders", json={"order_id": bad, "item": "x", "quantity": 1})
            assert r.status_code == 422, r.text
        r = await client.post(
            "/orders",
            json={"order_id": "traced", "item": "x", "quantity": 1},
            headers={"traceparent": "00-not-a-trace-01"},
        )
        assert r.status_code == 201, r.text
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(outbox.c.message_id, outbox.c.headers)).all()
    finally:
        engine.dispose()
    assert [m for m, _ in rows] == ["order-traced-created"]
    # a new trace: the current span's context, if a tracer is active in this process, never
    # the client's malformed header
    kept = (rows[0][1] or {}).get("traceparent")
    assert kept is None or (kept != "00-not-a-trace-01" and checked_headers(kept))
