"""Engines and migrations. Nothing here runs at import time: callers pass a URL or Settings."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from psycopg.types.array import ListBinaryDumper
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError

import migrations
from app.outbox.schema import VERSION_TABLE

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


#: TCP keepalives on every PostgreSQL connection (libpq's parameters)
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def session_limits(*, idle_in_transaction: float) -> dict[str, Any]:
    """``connect_args`` for a PostgreSQL engine whose sessions must not hold locks while their
    process is frozen (SIGSTOP, a GC pause, a VM migration, a debugger): the server ends a
    session idle inside a transaction for longer than ``idle_in_transaction`` seconds, which
    rolls it back and frees its locks."""
    ms = max(1000, int(idle_in_transaction * 1000))
    return {**KEEPALIVES, "options": f"-c idle_in_transaction_session_timeout={ms}"}


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for the outbox: SQLite in WAL mode with a busy timeout, PostgreSQL as given."""
    if url.startswith("sqlite"):
        kwargs.setdefault("connect_args", {"timeout": 30, "check_same_thread": False})
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 5)
    if url.startswith("postgresql"):
        # a peer that vanished (host down, VM paused, network cut) is noticed in about 25 s
        # instead of the kernel's two hours: its session and locks go
        args = kwargs.setdefault("connect_args", {})
        for key, value in KEEPALIVES.items():
            args.setdefault(key, value)
    engine = create_engine(url, **kwargs)
    if engine.dialect.driver == "psycopg":
        event.listen(engine, "connect", _binary_lists)
    return engine


#: The execution option that bounds a statement's time (:func:`bounded`).
BOUND = "outbox_statement_timeout"


def bounded(engine: Engine, seconds: float) -> Engine:
    """``engine``'s pool, with each statement run through the returned engine stopped once it
    ran ``seconds`` (0: no bound); statements through ``engine`` itself stay unbounded.

    PostgreSQL: ``SET LOCAL statement_timeout`` at the first statement of each transaction (a
    lock wait counts too). SQLite: a progress handler that interrupts the statement, its
    fetching included, past its deadline. The error is :func:`stopped_by_bound`'s."""
    if seconds <= 0:
        return engine
    if not event.contains(engine, "before_cursor_execute", _bound_statement):
        event.listen(engine, "before_cursor_execute", _bound_statement)
    return engine.execution_options(**{BOUND: float(seconds)})


def _bound_statement(
    conn: Connection, cursor: Any, _stmt: str, _params: Any, context: Any, _many: bool
) -> None:
    seconds = context.execution_options.get(BOUND) if context is not None else None
    if conn.dialect.name == "sqlite":
        dbapi = conn.connection.dbapi_connection
        if seconds:
            deadline = time.monotonic() + seconds
            dbapi.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)  # type: ignore[union-attr]
        else:
            dbapi.set_progress_handler(None, 10_000)  # type: ignore[union-attr]
        return
    if seconds and conn.dialect.name == "postgresql":
        transaction = conn.get_transaction()
        if conn.info.get(BOUND) is not transaction:  # once per transaction: SET LOCAL ends with it
            cursor.execute(f"SET LOCAL statement_timeout = {max(1, int(seconds * 1000))}")
            conn.info[BOUND] = transaction


def stopped_by_bound(exc: DBAPIError) -> bool:
    """Whether ``exc`` is a statement stopped by :func:`bounded` (or any statement timeout)."""
    orig = exc.orig
    if isinstance(orig, sqlite3.OperationalError):
        return "interrupted" in str(orig)
    return getattr(orig, "sqlstate", None) == "57014"  # query_canceled


def _binary_lists(dbapi_conn: Any, _record: Any) -> None:
    """Send Python lists (the repository's array parameters: a write-back's ids, delivery
    tags and publish times) in PostgreSQL's binary array format. psycopg's default for ``%s``
    is its text format, built in Python with a regular expression per element, on the
    write-back's path; the binary format is a copy of the values."""
    dbapi_conn.adapters.register_dumper(list, ListBinaryDumper)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["url"] = url
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision``."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


class SchemaMismatch(RuntimeError):
    """The database's outbox schema is not the one this code expects (the message says what
    to do)."""


def check_schema(engine: Engine) -> None:
    """Refuse to run on a database whose outbox schema is missing or at another revision."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    if current is None:
        raise SchemaMismatch(
            f"the database has no outbox schema ({VERSION_TABLE} is empty or missing): "
            "run `outbox migrate` first"
        )
    raise SchemaMismatch(
        f"the outbox schema is at revision {current}, this code expects {head}: run "
        "`outbox migrate` (or run the release that matches the database)"
    )
