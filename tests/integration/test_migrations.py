"""Migrations upgrade and downgrade cleanly on both backends, and plain-SQL inserts get defaults."""

from __future__ import annotations

from sqlalchemy import inspect, text

from app.db import current_revision, downgrade, head_revision, make_engine, migrate


def test_upgrade_downgrade_roundtrip(db_url: str) -> None:
    engine = make_engine(db_url)
    assert current_revision(engine) == head_revision()
    downgrade(db_url, "base")
    assert current_revision(engine) is None
    assert "outbox" not in inspect(engine).get_table_names()
    migrate(db_url)
    assert {
        "outbox",
        "outbox_batches",
        "outbox_audit",
        "outbox_rejects",
        "outbox_publishers",
    } <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_plain_sql_insert_gets_defaults(db_url: str) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body)"
                " VALUES ('m-1', 'plain:1', 'orders', 'order.created', :body)"
            ),
            {"body": b"{}"},
        )
        row = conn.execute(text("SELECT * FROM outbox")).mappings().one()
    assert row["status"] == "pending"
    assert row["attempts"] == 0 and row["max_attempts"] >= 1
    assert bool(row["mandatory"]) is True
    assert row["available_at"] is not None and row["created_at"] is not None
    engine.dispose()
