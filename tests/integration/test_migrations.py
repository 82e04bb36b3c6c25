"""Migrations upgrade and downgrade cleanly on both backends, and plain-SQL inserts get defaults."""

from __future__ import annotations

import importlib

import pytest
from alembic import command
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import DBAPIError

from app.db import (
    SchemaMismatch,
    alembic_config,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    migrate,
)
from app.outbox.schema import VERSION_TABLE


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


def test_a_plain_sql_stream_row_with_an_ordering_key_is_refused_and_nothing_else(
    db_url: str,
) -> None:
    """Migration 0022: the row is refused with the reason; valid stream and keyed rows, and an
    update that does not give a stream row a key, go through; the rows before it stay."""
    engine = make_engine(db_url)
    insert = text(
        "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, stream, "
        "ordering_key) VALUES (:m, 'plain:1', '', '', :body, :stream, :key)"
    )
    try:
        with engine.begin() as conn:
            conn.execute(insert, {"m": "s-1", "body": b"{}", "stream": "events", "key": None})
            conn.execute(insert, {"m": "k-1", "body": b"{}", "stream": None, "key": "order-7"})
        refusal = pytest.raises(DBAPIError, match="a stream row has no ordering key")
        with refusal as refused, engine.begin() as conn:
            conn.execute(insert, {"m": "s-2", "body": b"{}", "stream": "events", "key": "k"})
        if engine.dialect.name == "postgresql":
            assert getattr(refused.value.orig, "sqlstate", None) == "23514"  # check_violation
            assert "message_id s-2" in str(refused.value)
        give_key = text("UPDATE outbox SET ordering_key = 'k' WHERE message_id = 's-1'")
        with (
            pytest.raises(DBAPIError, match="a stream row has no ordering key"),
            engine.begin() as c,
        ):
            c.execute(give_key)
        with engine.begin() as conn:
            conn.execute(text("UPDATE outbox SET status = 'skipped' WHERE message_id = 's-1'"))
            got = conn.execute(text("SELECT message_id, status FROM outbox ORDER BY id")).all()
        assert [tuple(r) for r in got] == [("s-1", "skipped"), ("k-1", "pending")]
    finally:
        engine.dispose()


def test_the_outbox_keeps_its_own_version_table_beside_another_alembic_app(db_url: str) -> None:
    """Another Alembic application's ``alembic_version`` in the same database is never read or
    written: a full downgrade and upgrade leave it as it was."""
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('their_rev_42')"))
    downgrade(db_url, "base")
    migrate(db_url)
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        theirs = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        ours = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    assert theirs == ["their_rev_42"] and ours == [head_revision()]
    engine.dispose()


def test_an_install_from_before_the_own_version_table_is_adopted(db_url: str) -> None:
    """An older install kept its revision in alembic_version: the next migrate moves it into
    outbox_alembic_version and upgrades from there (no table created twice)."""
    engine = make_engine(db_url)
    downgrade(db_url, "0006")
    with engine.begin() as conn:  # as an install of the time left it
        conn.execute(text(f"DROP TABLE {VERSION_TABLE}"))
        conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('0006')"))
    migrate(db_url)
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar_one() == 0
    engine.dispose()


def test_a_publisher_refuses_a_schema_it_does_not_know(db_url: str) -> None:
    engine = make_engine(db_url)
    downgrade(db_url, "0006")
    with pytest.raises(
        SchemaMismatch, match=r"at revision 0006, this code expects .*outbox migrate"
    ):
        check_schema(engine)
    downgrade(db_url, "base")
    with pytest.raises(SchemaMismatch, match="no outbox schema"):
        check_schema(engine)
    migrate(db_url)
    check_schema(engine)
    engine.dispose()


def _reloptions(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        options = conn.execute(
            text("SELECT reloptions FROM pg_class WHERE oid = 'outbox'::regclass")
        ).scalar_one()
    return dict(o.split("=", 1) for o in options or [])


def test_the_outbox_vacuums_as_a_queue_and_keeps_an_operators_settings(pg_url: str) -> None:
    """PostgreSQL: the outbox's autovacuum settings are its own (migration 0020); a value an
    operator set before the migration is never overwritten, nor reset by a downgrade."""
    ours = importlib.import_module("migrations.versions.0020_outbox_autovacuum").SETTINGS
    engine = make_engine(pg_url)
    assert ours and _reloptions(engine) == ours
    downgrade(pg_url, "0019")
    assert _reloptions(engine) == {}
    key = next(iter(ours))
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE outbox SET ({key} = 7)"))
    migrate(pg_url)
    assert _reloptions(engine) == {**ours, key: "7"}
    downgrade(pg_url, "0019")
    assert _reloptions(engine) == {key: "7"}
    migrate(pg_url)
    engine.dispose()


def test_the_outbox_autovacuum_settings_are_written_by_an_offline_migration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``alembic upgrade --sql`` (no database to ask what an operator set): the settings are
    written as SQL, and the downgrade's SQL resets them."""
    cfg = alembic_config("postgresql+psycopg://nobody@127.0.0.1:1/none")
    command.upgrade(cfg, "0019:0020", sql=True)
    command.downgrade(cfg, "0020:0019", sql=True)
    out = capsys.readouterr().out
    ours = importlib.import_module("migrations.versions.0020_outbox_autovacuum").SETTINGS
    pairs = ", ".join(f"{k} = {v}" for k, v in ours.items())
    assert f"ALTER TABLE outbox SET ({pairs});" in out
    assert f"ALTER TABLE outbox RESET ({', '.join(ours)});" in out
