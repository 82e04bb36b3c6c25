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
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app.db import make_engine, migrate
from tests.support.env import (
    REPO,
    SERVICES,
    TEST_ENV,
    TEST_PREFIX,
    copy_database,
    database_url,
    drop_database,
    services_env,
)


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
    # Spark tests without the SparkSession fixture (spark-submit, a driver to kill, or the
    # writer's tasks called directly): each module a unit apart, free to run beside the session
    **{
        f"tests/spark/{name}.py": f"tests/spark/{name}.py"
        for name in (
            "test_cluster_recipe",
            "test_parked_rows",
            "test_readme_example",
            "test_rejects_visible",
            "test_replay_identity",
            "test_segments",
        )
    },
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
    given_stream = TEST_ENV.get(f"{TEST_PREFIX}STREAM_URL")
    if given_amqp and given_pg and given_stream:
        return {"amqp": given_amqp, "pg": given_pg, "stream": given_stream}
    subprocess.run([str(SERVICES), "start"], check=True, env=services_env())
    env = _local_env()
    return {
        "amqp": given_amqp or env["OUTBOX_AMQP_URL"],
        "pg": given_pg or env["OUTBOX_DATABASE_URL"],
        "stream": given_stream or env["OUTBOX_STREAM_URL"],
    }


@pytest.fixture(scope="session")
def amqp_url(service_urls: dict[str, str]) -> str:
    return service_urls["amqp"]


@pytest.fixture(scope="session")
def stream_url(service_urls: dict[str, str]) -> str:
    """The broker's stream protocol (rabbitmq_stream), beside ``amqp_url``."""
    return service_urls["stream"]


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
    from tests.support.cluster import Cluster, rabbitmq_missing

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
