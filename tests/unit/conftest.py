"""The unit lane needs no service: a unit test that asks for RabbitMQ or PostgreSQL fails here
instead of starting them (``make test-unit`` runs this folder on a machine with nothing running)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def service_urls() -> dict[str, str]:
    pytest.fail("a unit test asked for RabbitMQ or PostgreSQL: it belongs in tests/integration")
