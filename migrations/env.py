"""Alembic environment: the URL comes from the caller (``app.db.migrate``) or from Settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, inspect, pool, text

from app.outbox.schema import VERSION_TABLE, metadata

#: Where releases before 0.2 kept their revision: Alembic's shared default table.
LEGACY_VERSION_TABLE = "alembic_version"

config = context.config


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from app.settings import Settings

        url = Settings().database_url.get_secret_value()
    return str(url)


def run_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=metadata,
        literal_binds=True,
        render_as_batch=True,
        version_table=VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


def _run(connection: Connection) -> None:
    _adopt_legacy_version(connection)
    if connection.in_transaction():  # inspecting began one: end it, migrations bring their own
        connection.commit()
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=True,
        version_table=VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()


def _adopt_legacy_version(connection: Connection) -> None:
    """An install migrated before the outbox had its own version table kept its revision in
    ``alembic_version``, which another Alembic application in the same database may share. Move
    our revision (and only ours: one this script directory knows) into ``outbox_alembic_version``;
    leave any other application's row where it is."""
    tables = set(inspect(connection).get_table_names())
    if VERSION_TABLE in tables or LEGACY_VERSION_TABLE not in tables:
        return
    ours = {rev.revision for rev in context.script.walk_revisions()}
    found = connection.execute(text(f"SELECT version_num FROM {LEGACY_VERSION_TABLE}")).scalars()
    mine = [v for v in found if v in ours]
    if not mine or "outbox" not in tables:
        return
    connection.execute(
        text(
            f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL, "
            f"CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
        )
    )
    connection.execute(
        text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES (:v)"), {"v": mine[0]}
    )
    connection.execute(
        text(f"DELETE FROM {LEGACY_VERSION_TABLE} WHERE version_num = :v"), {"v": mine[0]}
    )
    connection.commit()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
