"""Fixtures shared by the integration tests: an engine on the test's database and a throw-away
exchange bound to a queue on the real broker."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import Engine

from app.db import make_engine
from tests.publisher_support import declare, delete


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
