"""Issue 48, Low 6: docker compose ran every part as a PostgreSQL superuser. The roles of
deploy/postgres/roles.sql, made here by psql from that file as compose's init script makes them,
each run its part for real on a database migrated by the owner role: the writer enqueues, the
publisher drains to RabbitMQ, the API reads and republishes; and none of the runtime roles can
create, drop, or do what only a superuser can."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.orm import Session

from app.api import create_app
from app.db import make_engine, migrate
from app.outbox.enqueue import Message, enqueue
from tests.support.api import OP, R, settings_for
from tests.support.env import REPO, database_url, drop_database
from tests.support.publisher import declare, delete, run_until_empty
from tests.support.publisher import settings_for as publisher_settings

ROLES_SQL = REPO / "deploy" / "postgres" / "roles.sql"
PARTS = ("owner", "publisher", "api", "writer")


@pytest.fixture
def roles(service_urls: dict[str, str]) -> Iterator[dict[str, str]]:
    """A new empty database and the four roles of roles.sql (names of this test's own); the
    owner migrates it. Yields each part's database URL; drops all of it afterwards."""
    admin_url = make_url(service_urls["pg"])
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    suffix = uuid.uuid4().hex[:8]
    db = f"outbox_roles_{suffix}"
    names = {part: f"outbox_{part}_{suffix}" for part in PARTS}
    passwords = {part: f"pw-{part}-{uuid.uuid4().hex}" for part in PARTS}
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db}"'))
    variables = [f"db={db}"]
    for part in PARTS:
        variables += [f"{part}={names[part]}", f"{part}_password={passwords[part]}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    env["PGPASSWORD"] = admin_url.password or ""
    try:
        done = subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(admin_url.host),
             "-p", str(admin_url.port), "-U", str(admin_url.username), "-d", db,
             *(arg for v in variables for arg in ("-v", v)), "-f", str(ROLES_SQL)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        urls = {
            part: make_url(database_url(service_urls, db))
            .set(username=names[part], password=passwords[part])
            .render_as_string(hide_password=False)
            for part in PARTS
        }
        migrate(urls["owner"])
        yield urls
    finally:
        drop_database(admin, db)
        with admin.connect() as conn:
            for part in PARTS:
                conn.execute(text(f'DROP ROLE IF EXISTS "{names[part]}"'))
        admin.dispose()


def _refused(url: str, statement: str) -> str:
    """The error PostgreSQL gives ``statement`` run by the role of ``url``."""
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with (
        psycopg.connect(conninfo, autocommit=True) as conn,
        pytest.raises(psycopg.Error) as refused,
    ):
        conn.execute(statement)
    return str(refused.value)


async def test_each_part_runs_with_its_own_role_and_none_can_do_more(
    roles: dict[str, str], amqp_url: str
) -> None:
    exchange, queue = f"roles-{uuid.uuid4().hex[:8]}", f"roles-q-{uuid.uuid4().hex[:8]}"
    await declare(amqp_url, exchange=exchange, queue=queue, routing_key="rk")
    engines: list[Engine] = []
    try:
        writer = make_engine(roles["writer"])
        engines.append(writer)
        with Session(writer) as session, session.begin():  # an application's enqueue
            messages = [
                Message(exchange=exchange, routing_key="rk", body=b"x", message_id=f"r-{i}")
                for i in range(5)
            ]
            assert len(enqueue(session, messages).inserted) == 5
        with writer.begin() as conn:  # the Spark writer stages rows in a temporary table
            conn.execute(text("CREATE TEMP TABLE outbox_stage (pos bigserial) ON COMMIT DROP"))

        publisher = make_engine(roles["publisher"])
        engines.append(publisher)
        stats = await run_until_empty(
            publisher_settings(db_url=roles["publisher"], amqp_url=amqp_url), publisher
        )
        assert stats.confirmed == 5

        owner = make_engine(roles["owner"])
        engines.append(owner)
        with owner.begin() as conn:  # one row as if its exchange had gone: a failure to act on
            conn.execute(text("UPDATE outbox SET status = 'failed' WHERE message_id = 'r-0'"))

        api = make_engine(roles["api"])
        engines.append(api)
        app = create_app(settings_for(roles["api"]), engine=api)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://outbox.test") as c:
            assert (await c.get("/v1/messages/r-1", headers=R)).json()["status"] == "confirmed"
            r = await c.post(
                "/v1/republish",
                json={"request_id": "roles-1", "message_id": "r-0", "statuses": ["failed"]},
                headers=OP,
            )
            assert r.status_code == 200 and r.json()["count"] == 1, r.text
            assert (await c.get("/ui/login")).status_code == 200  # the console's secret row
    finally:
        for engine in engines:
            engine.dispose()
        await delete(amqp_url, exchanges=(exchange,), queues=(queue,))

    for part in ("publisher", "api", "writer"):
        url = roles[part]
        assert "permission denied" in _refused(url, "CREATE TABLE mine (i int)"), part
        assert "must be owner" in _refused(url, "DROP TABLE outbox"), part
        assert "must be owner" in _refused(url, "ALTER TABLE outbox ADD COLUMN x int"), part
        said = _refused(url, "COPY outbox TO PROGRAM 'true'")
        assert "pg_execute_server_program" in said or "superuser" in said, part
    assert "permission denied" in _refused(roles["writer"], "CREATE DATABASE other")
