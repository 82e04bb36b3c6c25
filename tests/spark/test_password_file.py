"""The database password never has to be in Spark's conf, plan, UI or event log.

The URL names user, host and database; ``password_file`` (``passwordFile``) names a file on
every executor (a mounted secret) that the writer reads where it connects. The test database
requires a password over TCP (scram-sha-256), so a write without it fails.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sqlalchemy.engine import make_url

from spark_writer import OutboxConfigError, write_outbox
from tests.support import dbview
from tests.support.spark import orders, sink_options

pytestmark = pytest.mark.spark


def without_password(url: str) -> tuple[str, str]:
    u = make_url(url)
    assert u.password, "the test database is expected to need a password"
    return f"{u.drivername}://{u.username}@{u.host}:{u.port}/{u.database}", str(u.password)


def test_password_file_keeps_the_password_out_of_the_url(
    spark: SparkSession, pg_url: str, tmp_path: Path
) -> None:
    bare, password = without_password(pg_url)
    assert make_url(bare).password is None
    secret = tmp_path / "pg-password"
    secret.write_text(password + "\n")

    # the batch job and the data source, both reading the secret in their tasks
    result = write_outbox(
        orders(spark, 10), batch_id=1, password_file=str(secret), **sink_options(bare)
    )
    assert result.written == 10
    (
        orders(spark, 4)
        .withColumn("id", F.col("id") + 100)
        .write.format("outbox")
        .mode("append")
        .options(url=bare, passwordFile=str(secret), sink="ds", batchId="1", exchange="x")
        .options(routingKeyColumn="region", bodyColumn="payload", messageIdColumn="id")
        .save()
    )
    assert dbview.count(pg_url, "outbox") == 14

    # without it the server refuses the connection; a missing file is named, not its content
    with pytest.raises(psycopg.OperationalError, match="password"):
        write_outbox(orders(spark, 2), batch_id=2, **sink_options(bare))
    with pytest.raises(Exception, match=r"password_file '/nonexistent/pw' cannot be read here"):
        write_outbox(
            orders(spark, 2), batch_id=3, password_file="/nonexistent/pw", **sink_options(bare)
        )
    assert dbview.count(pg_url, "outbox") == 14


def test_password_file_with_a_password_in_the_url_or_sqlite_is_refused(
    pg_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    with pytest.raises(OutboxConfigError, match="take the password out of the url"):
        write_outbox(None, password_file=str(tmp_path / "pw"), **sink_options(pg_url))  # type: ignore[arg-type]
    with pytest.raises(OutboxConfigError, match="SQLite has no password"):
        write_outbox(None, password_file=str(tmp_path / "pw"), **sink_options(sqlite_url))  # type: ignore[arg-type]
