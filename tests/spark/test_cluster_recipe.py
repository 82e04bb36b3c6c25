"""The cluster recipe (deploy/spark/) works as written, and the password never reaches Spark.

``pack-env.sh`` packs the executors' Python environment (psycopg, pyarrow, pandas, the writer;
not pyspark); ``submit.sh`` ships it with ``--archives`` and runs the example streaming job.
Spark's ``local-cluster`` master starts a real executor JVM with its own working directory,
where the archive is unpacked and its interpreter runs the tasks, as on YARN, Kubernetes or a
standalone cluster. The database role has a password of its own that the job reads from a file:
it is in no Spark event log entry and nowhere in the job's output.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from app.db import make_engine
from tests.support import dbview

pytestmark = [pytest.mark.spark, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SPARK_DIR = REPO / "deploy" / "spark"


@pytest.fixture
def job_role(pg_url: str) -> Iterator[tuple[str, str]]:
    """A login role with a random password, allowed to write this test's outbox: (URL without
    the password, the password)."""
    name, password = f"job_{secrets.token_hex(4)}", f"pw-{secrets.token_hex(12)}"
    engine = make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'"))
        conn.execute(text(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {name}"))
        conn.execute(text(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {name}"))
    u = make_url(pg_url)
    yield f"{u.drivername}://{name}@{u.host}:{u.port}/{u.database}", password
    with engine.begin() as conn:
        conn.execute(text(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {name}"))
        conn.execute(text(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {name}"))
        conn.execute(text(f"DROP ROLE {name}"))
    engine.dispose()


def test_packed_environment_and_password_file_on_a_local_cluster(
    pg_url: str, job_role: tuple[str, str], tmp_path: Path
) -> None:
    url, password = job_role
    source = tmp_path / "in"
    source.mkdir()
    events = [
        {
            "event_id": f"e{i}",
            "event_type": "created",
            "order_id": f"o{i % 7}",
            "customer_id": "c1",
            "amount_cents": i,
            "currency": "EUR",
            "items": 1,
            "event_time": "2026-11-24T10:00:00Z",
        }
        for i in range(60)
    ]
    (source / "part-0.json").write_text("\n".join(json.dumps(e) for e in events))
    secret = tmp_path / "pg-password"
    secret.write_text(password + "\n")
    secret.chmod(0o600)
    archive = tmp_path / "outbox-env.tar.gz"
    packed = subprocess.run(
        [str(SPARK_DIR / "pack-env.sh"), str(archive)], capture_output=True, text=True, timeout=240
    )
    assert packed.returncode == 0, packed.stderr[-2000:]

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYSPARK_"))}
    env |= {
        "OUTBOX_DATABASE_URL": url,
        "OUTBOX_PASSWORD_FILE": str(secret),
        "OUTBOX_ENV_ARCHIVE": str(archive),
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_SUBMIT": str(Path(sys.executable).parent / "spark-submit"),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_SUBMIT_EXTRA": f"--conf spark.eventLog.enabled=true --conf "
        f"spark.eventLog.dir=file://{tmp_path / 'events'} --conf spark.eventLog.compress=false "
        "--conf spark.ui.enabled=false",
    }
    (tmp_path / "events").mkdir()
    job = subprocess.run(
        [
            str(SPARK_DIR / "submit.sh"),
            "local-cluster[1,2,1024]",
            str(source),
            str(tmp_path / "checkpoint"),
            "--once",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    rows = dbview.outbox(pg_url)
    assert sorted(r["message_id"] for r in rows) == sorted(e["event_id"] for e in events)
    # the executor JVM unpacked the archive in its own directory and ran its Python from it
    assert "environment" in job.stderr and "Unpacking an archive" in job.stderr
    logged = "".join(
        p.read_text(errors="replace") for p in (tmp_path / "events").rglob("*") if p.is_file()
    )
    assert "spark.pyspark.python" in logged  # the event log is there and holds the conf
    assert password not in logged and password not in job.stdout + job.stderr

    # a URL with a password in it is refused before Spark starts
    env["OUTBOX_DATABASE_URL"] = url.replace("@", f":{password}@")
    refused = subprocess.run(
        [str(SPARK_DIR / "submit.sh"), "local[1]", "in", "cp"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2 and "holds a password" in refused.stderr
