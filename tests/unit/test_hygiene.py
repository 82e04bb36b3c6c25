"""The suite never sees the service's own settings: the shell's ``OUTBOX_*`` are scrubbed."""

from __future__ import annotations

import os
import subprocess
import sys

from app.settings import Settings
from tests.support.env import REPO


def test_no_outbox_variable_reaches_a_test() -> None:
    assert [k for k in os.environ if k.startswith("OUTBOX_")] == []
    assert Settings().database_url.get_secret_value() == "sqlite:///outbox.db"


def test_an_operators_shell_cannot_point_the_suite_at_its_database() -> None:
    """Run the check above in a pytest whose shell exports a production database URL."""
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": "postgresql+psycopg://prod:pw@db.example/prod",
        "OUTBOX_AMQP_URL": "amqp://prod:pw@mq.example/",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_hygiene.py::test_no_outbox_variable_reaches_a_test",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
