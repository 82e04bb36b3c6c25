"""The orders service of ``orders_service.py``, written async: ``AsyncSession`` and
``enqueue_async`` on PostgreSQL through psycopg 3's async driver.

Run it against a migrated outbox database (``outbox migrate``) with a publisher draining it
(``outbox publish``)::

    ORDERS_DATABASE_URL=postgresql+psycopg://outbox:outbox@127.0.0.1:5433/outbox \\
        uvicorn --factory docs.examples.orders_service_async:app_from_env --port 8080
    curl -X POST localhost:8080/orders -H 'content-type: application/json' \\
        -d '{"order_id": "o-1", "item": "book", "quantity": 2}'

The same promises as the sync example: the order row and its ``order.created`` event commit
together or not at all; a retried request gets the same order and the same single message. The
handler never blocks the event loop: every statement is awaited on the async engine.
"""

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import CheckConstraint, Column, Integer, MetaData, Table, Text, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from app.outbox.enqueue import InvalidMessage, Message, MessageConflict, enqueue_async

metadata = MetaData()
orders = Table(
    "example_orders",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("item", Text, nullable=False),
    Column("quantity", Integer, nullable=False),
    CheckConstraint("quantity > 0", name="ck_example_orders_quantity"),
)


class OrderIn(BaseModel):
    order_id: str = Field(min_length=1, max_length=100)
    item: str = Field(min_length=1, max_length=200)
    quantity: int  # the database decides what a valid quantity is (its CHECK)


class OrderOut(BaseModel):
    order_id: str
    event_message_id: str
    duplicate: bool


def create_app(*, database_url: str, exchange: str = "orders") -> FastAPI:
    # postgresql+psycopg:// is psycopg 3, which is async as well: one URL for both worlds
    engine = create_async_engine(database_url, pool_pre_ping=True)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        yield
        await engine.dispose()

    app = FastAPI(title="orders (outbox example, async)", lifespan=lifespan)

    async def session() -> AsyncIterator[AsyncSession]:
        async with AsyncSession(engine) as s:
            yield s

    @app.post("/orders", response_model=OrderOut, status_code=201)
    async def create_order(
        order: OrderIn,
        s: Annotated[AsyncSession, Depends(session)],
        traceparent: Annotated[str | None, Header()] = None,
    ) -> OrderOut:
        event = Message(
            exchange=exchange,
            routing_key="order.created",
            message_id=f"order-{order.order_id}-created",
            body=json.dumps(order.model_dump()).encode(),
            content_type="application/json",
            properties={"type": "order.created"},
            ordering_key=order.order_id,
            # the caller's trace goes on with the event; a malformed header starts a new trace
            traceparent=traceparent,
        )
        try:
            async with s.begin():  # one transaction: the event first, then the order
                done = await enqueue_async(s, [event], source="orders-service")
                if not done.duplicates:
                    await s.execute(insert(orders).values(**order.model_dump()))
        except IntegrityError as exc:  # rolled back: the event with the order
            raise HTTPException(status_code=422, detail="order refused by the database") from exc
        except MessageConflict as exc:  # the same order id again, with other content
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        except InvalidMessage as exc:  # an id no message can carry (a NUL, over 255 bytes)
            raise HTTPException(status_code=422, detail=exc.reason) from exc
        return OrderOut(
            order_id=order.order_id,
            event_message_id=event.message_id,
            duplicate=bool(done.duplicates),
        )

    @app.get("/orders/{order_id}")
    async def get_order(
        order_id: str, s: Annotated[AsyncSession, Depends(session)]
    ) -> dict[str, object]:
        found = await s.execute(select(orders).where(orders.c.order_id == order_id))
        row = found.mappings().first()
        if row is None:
            raise HTTPException(status_code=404)
        return dict(row)

    app.state.engine = engine
    return app


def app_from_env() -> FastAPI:
    return create_app(
        database_url=os.environ["ORDERS_DATABASE_URL"],
        exchange=os.environ.get("ORDERS_EXCHANGE", "orders"),
    )
