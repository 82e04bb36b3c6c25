"""Alembic environment: the URL comes from the caller (``app.db.migrate``) or from Settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from app.outbox.schema import metadata

config = context.config


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from app.settings import Settings

        url = Settings().database_url.get_secret_value()
    return str(url)


def run_offline() -> None:
    context.configure(
        url=_url(), target_metadata=metadata, literal_binds=True, render_as_batch=True
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


def _run(connection: object) -> None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
