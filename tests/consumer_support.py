"""A handler for the consumer kit's tests: one row per message in ``consumer_effects`` (no
unique key, so a second effect would show), written in the kit's transaction."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from sqlalchemy import Connection, Engine, text

from app.consumer import Message

EFFECTS = """CREATE TABLE IF NOT EXISTS consumer_effects (
    n SERIAL PRIMARY KEY, message_id TEXT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now())"""


INSERT = text("INSERT INTO consumer_effects (message_id) VALUES (:m)")


def create_effects(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS))


def record(message: Message, conn: Connection) -> None:
    """The effect: a row. Header ``poison`` makes it raise; ``sleep_ms`` slows it."""
    if message.headers.get("poison"):
        raise ValueError(f"cannot process {message.message_id}")
    pause = message.headers.get("sleep_ms")
    if isinstance(pause, int) and pause > 0:
        time.sleep(pause / 1000)
    conn.execute(text("INSERT INTO consumer_effects (message_id) VALUES (:m)"),
                 {"m": message.message_id})  # fmt: skip


def effects(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT message_id FROM consumer_effects")).scalars())


def crash_or_record(message: Message, conn: Connection) -> None:
    """:func:`record`, but header ``crash`` kills the process (as a segfault or an OOM kill
    would): nothing after the handler runs, no exception reaches the kit."""
    if message.headers.get("crash"):
        os._exit(137)
    record(message, conn)


def record_all(messages: Sequence[Message], conn: Connection) -> None:
    """A batch handler: the window's effects in one ``executemany``; any ``poison`` fails it."""
    for message in messages:
        if message.headers.get("poison"):
            raise ValueError(f"cannot process {message.message_id}")
    conn.execute(INSERT, [{"m": m.message_id} for m in messages])
