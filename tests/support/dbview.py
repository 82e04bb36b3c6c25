"""Read what the writer left in the outbox tables, the same way on PostgreSQL and SQLite."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import text

from app.db import make_engine

OUTBOX_COLUMNS = (
    "message_id, batch_id, exchange, routing_key, mandatory, body, content_type, headers, "
    "ordering_key, properties, status, available_at"
)


def query(url: str, sql: str) -> list[dict[str, Any]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def outbox(url: str) -> list[dict[str, Any]]:
    """Outbox rows in id order, with headers as dicts, bodies as bytes, mandatory as bool."""
    rows = query(url, f"SELECT {OUTBOX_COLUMNS} FROM outbox ORDER BY id")
    for row in rows:
        if isinstance(row["headers"], str):
            row["headers"] = json.loads(row["headers"])
        row["body"] = bytes(row["body"])
        row["mandatory"] = bool(row["mandatory"])
        row["available_at"] = str(row["available_at"])
    return rows


def batches(url: str) -> list[dict[str, Any]]:
    return query(
        url,
        "SELECT batch_id, sink, spark_batch_id, query_id, row_count, rejected_count "
        "FROM outbox_batches ORDER BY batch_id",
    )


def rejects(url: str) -> list[dict[str, Any]]:
    return query(
        url, "SELECT batch_id, sink, message_id, reason, row_json FROM outbox_rejects ORDER BY id"
    )


def count(url: str, table: str) -> int:
    return int(query(url, f"SELECT count(*) AS n FROM {table}")[0]["n"])


def counts(url: str) -> dict[str, int]:
    return {t: count(url, t) for t in ("outbox", "outbox_batches", "outbox_rejects")}


def execute(url: str, sql: str) -> None:
    """Run one statement that returns no rows, committed."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()
