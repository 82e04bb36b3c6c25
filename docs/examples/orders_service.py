"""An orders service that writes an order and its ``order.created`` event in one transaction.

Run it against a migrated outbox database (``outbox migrate``) with a publisher draining it
(``outbox publish``)::

    ORDERS_DATABASE_URL=postgresql+psycopg://outbox:outbox@127.0.0.1:5433/outbox \\
        uvicorn --factory docs.examples.orders_service:app_from_env --port 8080
    curl -X POST localhost:8080/orders -H 'content-type: application/json' \\
        -d '{"order_id": "o-1", "item": "book", "quantity": 2}'

The order row and the outbox row commit together or not at all: an order the database refuses
(``quantity`` must be positive, the table's CHECK) rolls its event back with it, so no consumer
ever hears of an order that does not exist, and no order exists that consumers never hear of.
The message id is derived from the order id: a client that retries ``POST /orders`` after a
timeout gets the same order and the same single message, never a second one.
"""

import json
import os
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import CheckConstraint, Column, Integer, MetaData, Table, Text, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db import make_engine
from app.outbox.enqueue import InvalidMessage, Message, MessageConflict, enqueue

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
    engine = make_engine(database_url)
    metadata.create_all(engine)
    app = FastAPI(title="orders (outbox example)")

    def session() -> Iterator[Session]:
        with Session(engine) as s:
            yield s

    @app.post("/orders", response_model=OrderOut, status_code=201)
    def create_order(
        order: OrderIn,
        s: Annotated[Session, Depends(session)],
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
            with s.begin():  # one transaction: the event first, then the order
                done = enqueue(s, [event], source="orders-service")
                if not done.duplicates:
                    s.execute(insert(orders).values(**order.model_dump()))
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
    def get_order(order_id: str, s: Annotated[Session, Depends(session)]) -> dict[str, object]:
        row = s.execute(select(orders).where(orders.c.order_id == order_id)).mappings().first()
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
