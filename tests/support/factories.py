"""Test data: outbox rows inserted the way a Spark job or a plain SQL producer would."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import Engine, insert

from app.outbox.schema import outbox


def add_rows(
    engine: Engine,
    *,
    n: int,
    batch_id: str = "test:1",
    exchange: str = "ex",
    routing_key: str = "rk",
    body: bytes = b"x" * 256,
    prefix: str | None = None,
    sep: str = "-",
    **extra: Any,
) -> list[str]:
    """Insert ``n`` pending rows; return their message ids (in id order)."""
    prefix = prefix or uuid.uuid4().hex[:8]
    ids = [f"{prefix}{sep}{i}" for i in range(n)]
    rows = [
        {
            "message_id": m,
            "batch_id": batch_id,
            "exchange": exchange,
            "routing_key": routing_key,
            "body": body,
            **extra,
        }
        for m in ids
    ]
    with engine.begin() as conn:
        for start in range(0, n, 5000):
            conn.execute(insert(outbox), rows[start : start + 5000])
    return ids
