"""The REST API and the CLI republish exactly the scope they are given, routing key and reason
included (issue #28: a group's republish moved its exchange's other keys), on both backends."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import Engine, select

from app.api import create_app
from app.cli import EXIT_OK, EXIT_USAGE, main
from app.outbox.schema import audit, outbox
from tests.support.api import OP, Clock, client_for, settings_for
from tests.support.console import _settle
from tests.support.outbox_clients import OutboxClients


def _incident(engine: Engine) -> dict[str, list[str]]:
    repo = OutboxClients(engine, clock=Clock())
    return {
        "apac": _settle(
            repo,
            engine,
            n=3,
            exchange="orders",
            routing_key="apac",
            batch_id="b:1",
            outcome="returned",
        ),
        "latam": _settle(
            repo,
            engine,
            n=2,
            exchange="orders",
            routing_key="latam",
            batch_id="b:1",
            outcome="returned",
        ),
        "gone": _settle(
            repo,
            engine,
            n=2,
            exchange="orders",
            routing_key="apac",
            batch_id="b:1",
            outcome="failed",
            reason="exchange gone",
        ),
    }


def _pending(engine: Engine) -> set[str]:
    stmt = select(outbox.c.message_id).where(outbox.c.status == "pending")
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


async def test_the_api_moves_one_routing_key_and_audits_the_whole_filter(
    db_url: str, engine: Engine
) -> None:
    rows = _incident(engine)
    app = create_app(settings_for(db_url), engine=engine)
    body = {
        "request_id": "r-1",
        "statuses": ["returned"],
        "exchange": "orders",
        "routing_key": "apac",
        "reason": "NO_ROUTE",
    }
    async with client_for(app) as client:
        r = await client.post("/v1/republish", json=body, headers=OP)
        assert r.status_code == 200, r.text
        assert r.json()["count"] == 3 and r.json()["filter"]["routing_key"] == "apac"
        refused = await client.post("/v1/republish", json={"request_id": "r-2"}, headers=OP)
        assert refused.status_code == 422 and "say what to republish" in refused.text
    assert _pending(engine) == set(rows["apac"])
    with engine.connect() as conn:
        (doc,) = conn.execute(select(audit.c.filter)).scalars()
    assert (doc["routing_key"], doc["reason"]) == ("apac", "NO_ROUTE")


def test_the_cli_moves_one_routing_key_and_refuses_what_the_api_refuses(
    db_url: str,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", db_url)
    rows = _incident(engine)
    rc = main(["republish", "--routing-key", "latam", "--reason", "no_route"])
    out = capsys.readouterr().out
    assert rc == EXIT_OK and "routing key 'latam', reason containing 'no_route'" in out, out
    assert _pending(engine) == set(rows["latam"])
    assert main(["republish"]) == EXIT_USAGE
    assert "say what to republish" in capsys.readouterr().err


async def test_a_group_of_get_failures_republishes_exactly_with_its_reason_as_cause(
    db_url: str, engine: Engine
) -> None:
    rows = _incident(engine)
    app = create_app(settings_for(db_url), engine=engine)
    async with client_for(app) as client:
        groups = (await client.get("/v1/failures", headers=OP)).json()["groups"]
        (gone,) = [g for g in groups if g["status"] == "failed"]
        body = {
            "request_id": "r-3",
            "statuses": ["failed"],
            "exchange": gone["exchange"],
            "routing_key": gone["routing_key"],
            "cause": gone["reason"],
        }
        r = await client.post("/v1/republish", json=body, headers=OP)
    assert r.status_code == 200 and r.json()["count"] == gone["rows"] == 2, r.text
    assert _pending(engine) == set(rows["gone"])  # not the returned rows of the same key
