"""The consumer-side scenario's handler: one row per message in ``kit_effects`` (no unique key,
so a second effect of a message would show), written in the consumer kit's transaction."""

from __future__ import annotations

import os

from sqlalchemy import Connection, Engine, text

from app.consumer import Message

EFFECTS = """CREATE TABLE IF NOT EXISTS kit_effects (
    n BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL)"""


def create(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS))


def record(message: Message, conn: Connection) -> None:
    if message.headers.get("crash"):  # 15c's poison: the process dies, no exception
        os._exit(137)
    conn.execute(
        text("INSERT INTO kit_effects (message_id) VALUES (:m)"), {"m": message.message_id}
    )


def counts(engine: Engine) -> tuple[int, int]:
    """(effects, distinct messages with an effect)."""
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT count(*), count(DISTINCT message_id) FROM kit_effects")
        ).one()
    return int(row[0]), int(row[1])
