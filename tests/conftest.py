"""Shared fixtures: real RabbitMQ and PostgreSQL on loopback, fresh migrated databases per test.

Each run migrates once per backend and copies (test time is product time): PostgreSQL databases
are ``CREATE DATABASE ... TEMPLATE`` copies of one migrated template (about 20 ms with the drop,
where TRUNCATE of the 13 tables would save about as much and share state between tests), SQLite
files copies of one migrated file (0.5 ms against 0.12-0.7 s for a migration).

The suite never reads the service's own settings. Every ``OUTBOX_*`` variable of the calling shell
is removed from the test process's environment before any test runs (an operator's
``OUTBOX_DATABASE_URL`` must not become a database the tests create and drop in); the suite has
variables of its own:

- ``OUTBOX_TEST_AMQP_URL`` and ``OUTBOX_TEST_PG_ADMIN_URL``: use these running services (the
  latter is an admin connection that creates and drops one throw-away database per test);
- otherwise the local services of ``deploy/local/services.sh`` are started (if needed) on
  ``OUTBOX_TEST_AMQP_PORT`` (5673) and ``OUTBOX_TEST_PG_PORT`` (5433), data under
  ``OUTBOX_TEST_LOCAL_DIR`` (``.local``): the same instances ``make services`` starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import DBAPIError

from app.db import make_engine, migrate

REPO = Path(__file__).resolve().parent.parent
SERVICES = REPO / "deploy" / "local" / "services.sh"
TEST_PREFIX = "OUTBOX_TEST_"
#: The suite's own variables, read once before the environment is scrubbed.
TEST_ENV = {k: v for k, v in os.environ.items() if k.startswith(TEST_PREFIX)}


def scrubbed_environ(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """``environ`` without any ``OUTBOX_*`` variable (the suite's own ``OUTBOX_TEST_*`` too)."""
    return {k: v for k, v in environ.items() if not k.startswith("OUTBOX_")}


def _scrub_process_environment() -> None:
    for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
        del os.environ[name]


# At import, before any fixture or test module builds a Settings(): nothing of the shell leaks.
_scrub_process_environment()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist starts its workers after this module scrubbed the environment: hand them the
    suite's own variables, which their ``TEST_ENV`` takes in ``pytest_configure``."""
    node.workerinput[TEST_PREFIX] = dict(TEST_ENV)


def pytest_configure(config: pytest.Config) -> None:
    TEST_ENV.update(getattr(config, "workerinput", {}).get(TEST_PREFIX, {}))


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


def _local_env() -> dict[str, str]:
    out = subprocess.run(
        [str(SERVICES), "env"], check=True, capture_output=True, text=True, env=services_env()
    ).stdout
    pairs = (line.removeprefix("export ").split("=", 1) for line in out.splitlines() if "=" in line)
    return dict(pairs)


#: How ``make test`` shares the tests between its two workers (pytest-xdist, ``-n 2 --dist
#: loadscope``): each module is a unit of work that runs on one worker (its module-scoped
#: fixtures, a broker or a browser of its own, are built once), and the modules that share a
#: slow or port-bound session fixture are one unit together, so it is built once per run: the
#: SparkSession, the 1,000,000-row outbox, the three-node cluster on fixed ports. xdist hands the
#: units with the most tests out first. (Not ``xdist_group`` marks with ``--dist loadgroup``:
#: pytest 9.2 ignores the node ids that rewrites, pytest-dev/pytest-xdist#1386.)
UNITS = {
    "tests/spark/": "spark",
    "tests/integration/test_large_outbox.py": "large-outbox",
    "tests/integration/test_console_plans.py": "large-outbox",
    "tests/integration/test_cluster.py": "cluster",
}
#: the session fixtures built once per run, and the unit of every test that uses one
ONCE = {"spark": "spark", "large_database": "large-outbox", "cluster": "cluster"}


def work_unit(nodeid: str) -> str:
    """The unit a test runs in under two workers: its entry of ``UNITS``, or its module."""
    path = nodeid.split("::", 1)[0]
    return next((unit for prefix, unit in UNITS.items() if path.startswith(prefix)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with the units of ``work_unit``."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Units(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses a fixture of ``ONCE`` outside its unit fails the collection: two
    workers would each build it (or fight over its ports)."""
    wrong = []
    for item in items:
        names = getattr(item, "fixturenames", ())
        needed = {unit for fixture, unit in ONCE.items() if fixture in names}
        if needed - {work_unit(item.nodeid)}:
            wrong.append(f"{item.nodeid} needs unit {sorted(needed)[0]!r}")
    if wrong:
        raise pytest.UsageError("add to UNITS in tests/conftest.py:\n" + "\n".join(wrong))


@pytest.fixture(scope="session")
def service_urls() -> dict[str, str]:
    """AMQP and admin PostgreSQL URLs of running services: the suite's own variables, or the
    local services (started when needed)."""
    given_amqp = TEST_ENV.get(f"{TEST_PREFIX}AMQP_URL")
    given_pg = TEST_ENV.get(f"{TEST_PREFIX}PG_ADMIN_URL")
    if given_amqp and given_pg:
        return {"amqp": given_amqp, "pg": given_pg}
    subprocess.run([str(SERVICES), "start"], check=True, env=services_env())
    env = _local_env()
    return {
        "amqp": given_amqp or env["OUTBOX_AMQP_URL"],
        "pg": given_pg or env["OUTBOX_DATABASE_URL"],
    }


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
    migrate(database_url(service_urls, name))
    yield name
    drop_database(admin, name)
    admin.dispose()


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


@pytest.fixture
def pg_url(service_urls: dict[str, str], pg_template: str) -> Iterator[str]:
    """URL of a fresh, migrated PostgreSQL database of this test's own."""
    admin = make_engine(service_urls["pg"], isolation_level="AUTOCOMMIT")
    name = copy_database(admin, template=pg_template, prefix="outbox_t_")
    yield database_url(service_urls, name)
    drop_database(admin, name)
    admin.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file; each test copies it. Migrations leave it in rollback-journal
    mode with every connection closed, so the file alone is the whole database."""
    path = tmp_path_factory.mktemp("sqlite-template") / "outbox.db"
    migrate(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_template: Path) -> str:
    """URL of a fresh, migrated SQLite file of this test's own (a copy of the template)."""
    path = tmp_path / "outbox.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """The same test on both backends (one behaviour contract for every backend)."""
    name = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(name))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    """A three-node RabbitMQ cluster of the suite's own (``OUTBOX_TEST_CLUSTER_PORT``, default
    5791-5793), started once per session and stopped after it; skipped, saying why, only when
    rabbitmq-server is not installed. ``OUTBOX_TEST_CLUSTER_KEEP=1`` leaves it running."""
    from tests.cluster_support import Cluster, rabbitmq_missing

    missing = rabbitmq_missing()
    if missing is not None:
        pytest.skip(f"no three-node cluster: {missing}")
    local = TEST_ENV.get(f"{TEST_PREFIX}LOCAL_DIR", str(REPO / ".local"))
    nodes = Cluster(
        base_port=int(TEST_ENV.get(f"{TEST_PREFIX}CLUSTER_PORT", "5791")), local_dir=local
    )
    nodes.start()
    try:
        yield nodes
    finally:
        if TEST_ENV.get(f"{TEST_PREFIX}CLUSTER_KEEP") != "1":  # 1: keep it for the next run
            nodes.stop()
