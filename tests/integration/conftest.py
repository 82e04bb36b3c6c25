"""Fixtures shared by the integration tests: an engine on the test's database, a throw-away
exchange bound to a queue on the real broker, and the 1,000,000-row outbox (built once)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import Engine

from app.db import make_engine
from tests.support.env import copy_database, database_url, drop_database
from tests.support.large_outbox import build
from tests.support.publisher import declare, delete


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on the test's fresh database (PostgreSQL and SQLite via ``db_url``)."""
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
async def topology(amqp_url: str, request: pytest.FixtureRequest) -> AsyncIterator[dict[str, str]]:
    """A direct exchange bound to a durable queue with routing key ``rk``, named after the test
    module; deleted afterwards."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    names = {"exchange": f"test-{module}-{uuid.uuid4().hex[:8]}"}
    names["queue"] = names["exchange"] + "-q"
    await declare(amqp_url, exchange=names["exchange"], queue=names["queue"])
    yield names
    await delete(amqp_url, exchanges=(names["exchange"],), queues=(names["queue"],))


@pytest.fixture(scope="session")
def large_database(service_urls: dict[str, str], pg_template: str) -> Iterator[str]:
    """The name of the 1,000,000-row database (``tests/support/large_outbox.py``), built once
    per run (about 30 s) for every test that reads it; dropped at the end."""
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = copy_database(admin, template=pg_template, prefix="outbox_large_")
    engine = make_engine(database_url(service_urls, name))
    try:
        build(engine)
    finally:
        engine.dispose()
    yield name
    drop_database(admin, name)
    admin.dispose()


@pytest.fixture(scope="session")
def large(service_urls: dict[str, str], large_database: str) -> Iterator[Engine]:
    """An engine on the 1,000,000-row outbox. Its tests only read it; a test that changes rows
    takes ``large_copy``."""
    engine = make_engine(database_url(service_urls, large_database))
    yield engine
    engine.dispose()


@pytest.fixture
def large_copy(
    service_urls: dict[str, str], large_database: str, large: Engine
) -> Iterator[Engine]:
    """An engine on a copy of the 1,000,000-row outbox, this test's own to change."""
    large.dispose()  # PostgreSQL copies a database only while nobody is connected to it
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = copy_database(admin, template=large_database, prefix="outbox_large_copy_")
    engine = make_engine(database_url(service_urls, name))
    yield engine
    engine.dispose()
    drop_database(admin, name)
    admin.dispose()
