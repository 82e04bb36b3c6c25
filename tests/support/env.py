"""The suite's ground: the repository, the local services and their environment, the shell's
OUTBOX_* kept out of every process a test starts, a broker connection closed by name, and the
throw-away databases (copies of one migrated template)."""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from pathlib import Path

from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import DBAPIError

REPO = Path(__file__).resolve().parents[2]


SERVICES = REPO / "deploy" / "local" / "services.sh"


TEST_PREFIX = "OUTBOX_TEST_"


#: The suite's own variables, read once before the environment is scrubbed.
TEST_ENV = {k: v for k, v in os.environ.items() if k.startswith(TEST_PREFIX)}


def scrubbed_environ(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """``environ`` without any ``OUTBOX_*`` variable (the suite's own ``OUTBOX_TEST_*`` too)."""
    return {k: v for k, v in environ.items() if not k.startswith("OUTBOX_")}


def services_env() -> dict[str, str]:
    """The environment for ``services.sh``: the suite's ports and data directory only."""
    env = scrubbed_environ(os.environ)
    env["OUTBOX_LOCAL_AMQP_PORT"] = TEST_ENV.get(f"{TEST_PREFIX}AMQP_PORT", "5673")
    env["OUTBOX_LOCAL_PG_PORT"] = TEST_ENV.get(f"{TEST_PREFIX}PG_PORT", "5433")
    if f"{TEST_PREFIX}LOCAL_DIR" in TEST_ENV:
        env["OUTBOX_LOCAL_DIR"] = TEST_ENV[f"{TEST_PREFIX}LOCAL_DIR"]
    return env


def close_broker_connections(
    named: str, *, reason: str = "closed by a test", wait: float = 15.0
) -> int:
    """``rabbitmqctl close_connection`` on the connections whose client-provided name contains
    ``named``, and only those: never a connection another test or suite owns (unlike
    ``close_all_connections``). Waits up to ``wait`` seconds for such a connection to exist (the
    client may be reconnecting). Returns how many were closed."""
    deadline = time.monotonic() + wait
    while True:
        closed = _close_named(named, reason)
        if closed or time.monotonic() > deadline:
            return closed
        time.sleep(0.2)


def _close_named(named: str, reason: str) -> int:
    listing = subprocess.run(
        [str(SERVICES), "ctl", "list_connections", "-q", "pid", "client_properties"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=services_env(),
    ).stdout
    closed = 0
    for line in listing.splitlines():
        pid, _, props = line.partition("\t")
        found = re.search(r'\{"connection_name","([^"]*)"\}', props)
        if pid.startswith("<") and found and named in found.group(1):
            done = subprocess.run(
                [str(SERVICES), "ctl", "close_connection", pid, reason],
                capture_output=True,
                timeout=60,
                env=services_env(),
            )
            closed += done.returncode == 0  # a connection may end between listing and closing
    return closed


def database_url(service_urls: dict[str, str], name: str) -> str:
    """The URL of database ``name`` on the suite's PostgreSQL."""
    return make_url(service_urls["pg"]).set(database=name).render_as_string(hide_password=False)


def copy_database(admin: Engine, *, template: str, prefix: str) -> str:
    """A new database ``prefix...`` copied from ``template``; retried, since PostgreSQL copies
    only a template nobody is connected to (an autovacuum worker may be)."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    for attempt in range(40):
        try:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
            return name
        except DBAPIError:
            if attempt == 39:
                raise
            time.sleep(0.25)
    raise AssertionError("unreachable")


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
