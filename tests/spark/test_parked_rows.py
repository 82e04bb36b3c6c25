"""Rows the data source parked for a batch that never committed are not hidden.

``format("outbox")`` in fail mode writes each partition parked and the driver's commit releases
them. A driver that dies between the tasks and the commit leaves them parked: they are counted
apart in ``outbox status`` (text and JSON, the same as ``GET /v1/stats``), do not pass for slow
publishing in the oldest-pending figure, and ``status --check`` warns once they are old. The
rows are written by the product's own task function (``write_partition``), as an executor does.
"""

from __future__ import annotations

import datetime as dt
import json
import os

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType
from sqlalchemy import update

from app.cli import main
from app.db import make_engine
from app.outbox.schema import outbox
from spark_writer import OutboxOptions
from spark_writer.envelope import BatchRef
from spark_writer.writer import WritePlan, commit_batch, write_partition
from tests.support import dbview

pytestmark = pytest.mark.spark

SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("payload", StringType()),
    ]
)


def status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["status", *argv])
    return rc, capsys.readouterr().out


def test_parked_rows_of_an_uncommitted_batch_are_counted_apart_and_warned_about(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", db_url)
    options = OutboxOptions(
        url=db_url,
        sink="ds",
        exchange="x",
        routing_key_column="region",
        body_column="payload",
        message_id_column="id",
    )
    batch = BatchRef(sink="ds", spark_batch_id=7)
    plan = WritePlan(options=options, schema=SCHEMA, batch=batch, park=True)
    rows = pa.RecordBatch.from_pydict(
        {"id": [1, 2, 3], "region": ["eu"] * 3, "payload": ["a", "b", "c"]}
    )
    result = write_partition([rows], plan=plan, partition=0, attempt=0)
    assert result.inserted == 3  # the task committed; its driver "dies" before commit_batch

    rc, out = status(capsys, "--json")
    body = json.loads(out)
    assert (body["parked"], body["counts"]["pending"]) == (3, 3)
    assert body["oldest_pending_age_seconds"] is None  # nothing waits for a publisher
    # an hour later the operator is told what they are and what to do
    engine = make_engine(db_url)
    with engine.begin() as conn:
        old = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
        conn.execute(update(outbox).values(created_at=old))
    rc, out = status(capsys, "--check")
    assert rc == 1, out  # WARNING
    assert "3 rows parked by a Spark batch in fail mode that was never recorded" in out
    assert "re-run that batch to release them" in out
    rc, out = status(capsys)
    assert "parked (uncommitted)  3, oldest 1h" in out

    # the re-run's commit releases them: due now, no longer parked
    commit_batch(options=options, batch=batch, results=[result], parked=True)
    body = json.loads(status(capsys, "--json")[1])
    assert (body["parked"], body["counts"]["pending"]) == (0, 3)
    assert body["oldest_pending_age_seconds"] >= 3600
    assert not [r for r in dbview.outbox(db_url) if r["available_at"].startswith("9999")]
    engine.dispose()
