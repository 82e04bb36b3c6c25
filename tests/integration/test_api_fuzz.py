"""Property-based fuzzing of the REST API from its own OpenAPI schema (schemathesis).

Every operation gets generated requests, valid and invalid, with the operator token, in process
(ASGI, no network), against a real database seeded with rows in every state. No answer may be a
5xx or break the schema the app publishes. Bounded: a fixed number of examples per operation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from pydantic import SecretStr
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from app.api import create_app
from app.db import make_engine
from tests.support.api import OP, Clock, seed_every_state, settings_for

MAX_EXAMPLES = 60
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


#: Only its OpenAPI document is read (importing needs no database); calls go to ``app`` below.
#: (schemathesis' lazy ``from_fixture`` loader does not work with pytest 9.2: it sets
#: ``request.node._nodeid``, which pytest no longer has.)
schema = schemathesis.openapi.from_asgi(
    "/openapi.json", create_app(settings_for("sqlite://", api_docs=True))
)


@pytest.fixture
def app(db_url: str, amqp_url: str) -> Iterator[FastAPI]:
    """The API on a real database holding rows in every state, shared by all examples."""
    engine = make_engine(db_url)
    clock = Clock()
    seed_every_state(engine, clock)
    # the fuzzer sends many bad tokens from one client: a throttle would answer 429 to the rest
    settings = settings_for(
        db_url,
        amqp_url=SecretStr(amqp_url),
        api_probe_timeout=5.0,
        api_auth_failures_per_minute=1_000_000,
    )
    yield create_app(settings, clock=clock, engine=engine)
    engine.dispose()


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
def test_no_input_gets_a_5xx_or_an_answer_outside_the_schema(
    case: schemathesis.Case, app: FastAPI
) -> None:
    # The operator token goes on every request, except when the generator broke the headers on
    # purpose (a missing Authorization is the invalid part): adding the token back would turn a
    # negative case into a valid one, and its 200 into a false "invalid data accepted".
    meta = case.meta
    broken_headers = meta is not None and any(
        location.name == "HEADER" and info.mode.is_negative
        for location, info in meta.components.items()
    )
    case.call_and_validate(app=app, headers=None if broken_headers else OP, checks=CHECKS)
