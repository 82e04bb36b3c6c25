"""The application API against the INSERT an application would write by hand: 10,000 messages in
one transaction on PostgreSQL, each 256 bytes with a header and a property, like an order event.

- ``enqueue_api_10k_ms``: ``app.outbox.enqueue.enqueue`` on a SQLAlchemy ``Session`` (checks every
  message, ``INSERT … ON CONFLICT DO NOTHING RETURNING`` per 1,000 rows);
- ``enqueue_raw_executemany_10k_ms``: ``Connection.execute(insert(outbox), rows)`` with the same
  rows (SQLAlchemy's executemany, no checks, no idempotence): the baseline of the issue's target,
  the API at most 1.2 x this;
- ``enqueue_psycopg_10k_ms`` and ``enqueue_raw_psycopg_executemany_10k_ms``: the same pair on a
  plain psycopg connection (``enqueue_psycopg`` against ``cursor.executemany``).

And the ordinary web case, one message per transaction (issue 48, Low 10: it cost 2.09-2.24 x
a plain INSERT), :data:`ONE_TX` transactions in a row on one pooled connection, each timed from
its first statement to its COMMIT, in microseconds per transaction, with the client's CPU:

- ``enqueue_one_per_tx_us``: ``enqueue(conn, [message])`` on a SQLAlchemy ``Connection``;
- ``enqueue_raw_one_per_tx_us``: ``conn.execute(insert(outbox), row)`` on the same connection;
- ``enqueue_psycopg_one_per_tx_us`` and ``enqueue_raw_psycopg_one_per_tx_us``: the same pair on
  a plain psycopg connection (``enqueue_psycopg`` against ``cursor.execute``).

Each run starts from an empty outbox (TRUNCATE, not timed) and is timed from the first statement
to the COMMIT. Variants alternate within each round, so a slow moment of the shared machine falls
on all of them. ``python -m bench.workloads.enqueue`` runs this workload alone.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
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


#: Transactions of one message per run of the single-message variants.
ONE_TX = 1000
ONE_KEYS = (
    "enqueue_one_per_tx_us",
    "enqueue_raw_one_per_tx_us",
    "enqueue_psycopg_one_per_tx_us",
    "enqueue_raw_psycopg_one_per_tx_us",
)


def _one_per_tx(engine: Engine, url: str, run: int) -> dict[str, tuple[float, float]]:
    """Each single-message variant, alternating: (wall µs, client CPU µs) per transaction."""
    messages = _messages(run)[:ONE_TX]
    rows = _rows(run)[:ONE_TX]
    raw_rows = [
        {**r, "message_id": "raw-" + r["message_id"], "headers": Json(r["headers"])} for r in rows
    ]
    for r in raw_rows:
        r["properties"] = Json(r["properties"])
    sa_rows = [{**r, "message_id": "sa-" + r["message_id"]} for r in rows]
    out: dict[str, tuple[float, float]] = {}
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox"))

    def timed(key: str, one: Callable[[int], None]) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(ONE_TX):
            one(i)
        out[key] = (
            (time.perf_counter() - wall) / ONE_TX * 1e6,
            (time.process_time() - cpu) / ONE_TX * 1e6,
        )

    with engine.connect() as conn:

        def api(i: int) -> None:
            with conn.begin():
                enqueue(conn, [messages[i]])

        def raw(i: int) -> None:
            with conn.begin():
                conn.execute(insert(outbox), sa_rows[i])

        timed("enqueue_one_per_tx_us", api)
        timed("enqueue_raw_one_per_tx_us", raw)
    with psycopg.connect(url) as pconn, pconn.cursor() as cur:

        def api_psycopg(i: int) -> None:
            enqueue_psycopg(pconn, [dataclasses.replace(messages[i], message_id=f"pg-{i}")])
            pconn.commit()

        def raw_psycopg(i: int) -> None:
            cur.execute(_RAW_SQL, raw_rows[i])
            pconn.commit()

        timed("enqueue_psycopg_one_per_tx_us", api_psycopg)
        timed("enqueue_raw_psycopg_one_per_tx_us", raw_psycopg)
    return out


def run(services: Services, sizes: Sizes) -> list[Measured]:
    del sizes  # the figure is for 10,000 messages at any scale
    keys = [
        "enqueue_api_10k_ms",
        "enqueue_raw_executemany_10k_ms",
        "enqueue_psycopg_10k_ms",
        "enqueue_raw_psycopg_executemany_10k_ms",
    ]
    out = {key: Measured(key=key, unit="ms") for key in keys}
    one = {key: Measured(key=key, unit="us") for key in ONE_KEYS}
    cpu: dict[str, list[float]] = {key: [] for key in ONE_KEYS}
    with temp_postgres(services) as url:
        engine = make_engine(url)
        libpq = libpq_url(url)
        try:
            _timed(engine, _api(engine, -1))  # warm up: connections, statement caches
            _one_per_tx(engine, libpq, -1)
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
                for key, (wall_us, cpu_us) in _one_per_tx(engine, libpq, i).items():
                    one[key].runs.append(wall_us)
                    cpu[key].append(cpu_us)
                    print(f"  {key} run {i + 1}/{ROUNDS}: {wall_us:,.0f} us", flush=True)
        finally:
            engine.dispose()
    for key, measured in one.items():
        measured.extra["client_cpu_us_per_tx"] = round(statistics.median(cpu[key]), 1)
    out.update(one)
    return list(out.values())


if __name__ == "__main__":
    found = run(Services.from_env(), Sizes.from_env())
    figures = {m.key: round(m.value, 1) for m in found}
    figures["ratio_api"] = round(figures[found[0].key] / figures[found[1].key], 3)
    figures["ratio_psycopg"] = round(figures[found[2].key] / figures[found[3].key], 3)
    by_key = {m.key: m for m in found}
    for api, raw in (ONE_KEYS[:2], ONE_KEYS[2:]):
        figures[f"ratio_{api}"] = round(by_key[api].value / by_key[raw].value, 3)
        for key in (api, raw):
            figures[f"{key}_cpu"] = by_key[key].extra["client_cpu_us_per_tx"]
    print(json.dumps(figures, indent=2))
