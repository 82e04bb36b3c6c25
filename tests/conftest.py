"""Shared fixtures: real RabbitMQ and PostgreSQL on loopback, fresh migrated databases per test.

The services come from ``deploy/local/services.sh`` (started here if needed), or from
``OUTBOX_AMQP_URL`` / ``OUTBOX_DATABASE_URL`` when they are set (the latter must be PostgreSQL;
it is used as the admin connection that creates one throw-away database per test).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import DBAPIError

from app.db import make_engine, migrate

REPO = Path(__file__).resolve().parent.parent
SERVICES = REPO / "deploy" / "local" / "services.sh"


def _local_env() -> dict[str, str]:
    out = subprocess.run([str(SERVICES), "env"], check=True, capture_output=True, text=True).stdout
    pairs = (line.removeprefix("export ").split("=", 1) for line in out.splitlines() if "=" in line)
    return dict(pairs)


@pytest.fixture(scope="session")
def service_urls() -> dict[str, str]:
    """AMQP and PostgreSQL URLs of running services; starts the local ones when none are given."""
    given_db = os.environ.get("OUTBOX_DATABASE_URL", "")
    given_amqp = os.environ.get("OUTBOX_AMQP_URL")
    if given_amqp and given_db.startswith("postgresql"):
        return {"amqp": given_amqp, "pg": given_db}
    subprocess.run([str(SERVICES), "start"], check=True)
    env = _local_env()
    return {"amqp": given_amqp or env["OUTBOX_AMQP_URL"], "pg": env["OUTBOX_DATABASE_URL"]}


@pytest.fixture(scope="session")
def amqp_url(service_urls: dict[str, str]) -> str:
    return service_urls["amqp"]


@pytest.fixture(scope="session")
def pg_template(service_urls: dict[str, str]) -> Iterator[str]:
    """A migrated template database; each test copies it (``CREATE DATABASE ... TEMPLATE``)."""
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = f"outbox_tmpl_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(service_urls["pg"]).set(database=name).render_as_string(hide_password=False)
    migrate(url)
    yield name
    drop_database(admin, name)
    admin.dispose()


def drop_database(admin: Engine, name: str) -> None:
    """Drop a test database; retried, since a background worker (autovacuum) may be inside it."""
    for attempt in range(20):
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            return
        except DBAPIError:
            if attempt == 19:
                raise
            time.sleep(0.25)


@pytest.fixture
def pg_url(service_urls: dict[str, str], pg_template: str) -> Iterator[str]:
    """URL of a fresh, migrated PostgreSQL database of this test's own."""
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = f"outbox_t_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"'))
    yield make_url(service_urls["pg"]).set(database=name).render_as_string(hide_password=False)
    drop_database(admin, name)
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """URL of a fresh, migrated SQLite file of this test's own."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    migrate(url)
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The same test on both backends (one behaviour contract for every backend)."""
    name = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(name))
