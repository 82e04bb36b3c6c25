"""The application API against the INSERT an application would write by hand: 10,000 messages in
one transaction on PostgreSQL, each 256 bytes with a header and a property, like an order event.

- ``enqueue_api_10k_ms``: ``app.outbox.enqueue.enqueue`` on a SQLAlchemy ``Session`` (checks every
  message, ``INSERT … ON CONFLICT DO NOTHING RETURNING`` per 1,000 rows);
- ``enqueue_raw_executemany_10k_ms``: ``Connection.execute(insert(outbox), rows)`` with the same
  rows (SQLAlchemy's executemany, no checks, no idempotence): the baseline of the issue's target,
  the API at most 1.2 x this;
- ``enqueue_psycopg_10k_ms`` and ``enqueue_raw_psycopg_executemany_10k_ms``: the same pair on a
  plain psycopg connection (``enqueue_psycopg`` against ``cursor.executemany``).

Each run starts from an empty outbox (TRUNCATE, not timed) and is timed from the first statement
to the COMMIT. Variants alternate within each round, so a slow moment of the shared machine falls
on all of them. ``python -m bench.workloads.enqueue`` runs this workload alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Json
from sqlalchemy import Engine, insert, text
from sqlalchemy.orm import Session

from app.db import make_engine
from app.outbox.enqueue import Message, enqueue, enqueue_psycopg
from app.outbox.schema import outbox
from bench.common import BODY, REPEATS, Measured, Services, Sizes, libpq_url, temp_postgres

MESSAGES = 10_000
#: Rounds of the four variants, alternating: at least 15, since one commit of 10,000 rows swings
#: by up to 2 x on this machine's disk (three rounds' medians moved the ratio 0.72-0.87).
ROUNDS = max(REPEATS, 15)
HEADERS = {"tenant": "t-1"}
PROPERTIES = {"type": "order.created"}


def _messages(run: int) -> list[Message]:
    return [
        Message(
            exchange="orders",
            routing_key="order.created",
            body=BODY,
            message_id=f"r{run}-m{i}",
            content_type="application/json",
            headers=HEADERS,
            properties=PROPERTIES,
        )
        for i in range(MESSAGES)
    ]


def _rows(run: int) -> list[dict[str, Any]]:
    return [
        {
            "message_id": f"r{run}-m{i}",
            "batch_id": "app",
            "exchange": "orders",
            "routing_key": "order.created",
            "body": BODY,
            "content_type": "application/json",
            "headers": HEADERS,
            "properties": PROPERTIES,
        }
        for i in range(MESSAGES)
    ]


def _timed(engine: Engine, work: Callable[[], None]) -> float:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox"))
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1000


def _api(engine: Engine, run: int) -> Callable[[], None]:
    messages = _messages(run)

    def work() -> None:
        with Session(engine) as session, session.begin():
            enqueue(session, messages)

    return work


def _raw(engine: Engine, run: int) -> Callable[[], None]:
    rows = _rows(run)

    def work() -> None:
        with engine.begin() as conn:
            conn.execute(insert(outbox), rows)

    return work


def _api_psycopg(url: str, run: int) -> Callable[[], None]:
    messages = _messages(run)

    def work() -> None:
        with psycopg.connect(url) as conn:
            enqueue_psycopg(conn, messages)

    return work


_RAW_SQL = (
    "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, content_type,"
    " headers, properties) VALUES (%(message_id)s, %(batch_id)s, %(exchange)s, %(routing_key)s,"
    " %(body)s, %(content_type)s, %(headers)s, %(properties)s)"
)


def _raw_psycopg(url: str, run: int) -> Callable[[], None]:
    rows = [
        {**r, "headers": Json(r["headers"]), "properties": Json(r["properties"])}
        for r in _rows(run)
    ]

    def work() -> None:
        with psycopg.connect(url) as conn, conn.cursor() as cur:
            cur.executemany(_RAW_SQL, rows)

    return work


def run(services: Services, sizes: Sizes) -> list[Measured]:
    del sizes  # the figure is for 10,000 messages at any scale
    keys = [
        "enqueue_api_10k_ms",
        "enqueue_raw_executemany_10k_ms",
        "enqueue_psycopg_10k_ms",
        "enqueue_raw_psycopg_executemany_10k_ms",
    ]
    out = {key: Measured(key=key, unit="ms") for key in keys}
    with temp_postgres(services) as url:
        engine = make_engine(url)
        libpq = libpq_url(url)
        try:
            _timed(engine, _api(engine, -1))  # warm up: connections, statement caches
            for i in range(ROUNDS):
                variants = [
                    _api(engine, i),
                    _raw(engine, i),
                    _api_psycopg(libpq, i),
                    _raw_psycopg(libpq, i),
                ]
                for key, work in zip(keys, variants, strict=True):
                    ms = _timed(engine, work)
                    out[key].runs.append(ms)
                    print(f"  {key} run {i + 1}/{ROUNDS}: {ms:,.0f} ms", flush=True)
        finally:
            engine.dispose()
    return list(out.values())


if __name__ == "__main__":
    found = run(Services.from_env(), Sizes.from_env())
    figures = {m.key: round(m.value, 1) for m in found}
    figures["ratio_api"] = round(figures[found[0].key] / figures[found[1].key], 3)
    figures["ratio_psycopg"] = round(figures[found[2].key] / figures[found[3].key], 3)
    print(json.dumps(figures, indent=2))
