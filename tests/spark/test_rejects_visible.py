"""Rows the Spark writer refused are visible where operators look: ``outbox rejects`` (text and
JSON) and ``GET /v1/rejects`` (newest first, per batch, keyset pages). The rejects are written by
the product's own task function (``write_partition``) in reject mode: bad values and a message
id conflict."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from app.api.app import create_app
from app.cli import main
from app.db import make_engine
from spark_writer import OutboxOptions
from spark_writer.envelope import BatchRef
from spark_writer.writer import WritePlan, commit_batch, write_partition
from tests.support.api import R, client_for, settings_for

pytestmark = pytest.mark.spark

SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("payload", StringType()),
    ]
)


def write(url: str, sink: str, ids: list[int], regions: list[str | None]) -> None:
    options = OutboxOptions(
        url=url,
        sink=sink,
        exchange="x",
        routing_key_column="region",
        body_column="payload",
        message_id_column="id",
        on_invalid="reject",
    )
    plan = WritePlan(options=options, schema=SCHEMA, batch=BatchRef(sink=sink, spark_batch_id=1))
    rows = pa.RecordBatch.from_pydict(
        {"id": ids, "region": regions, "payload": [f"{sink} {i}" for i in ids]}
    )
    result = write_partition([rows], plan=plan, partition=0, attempt=0)
    commit_batch(options=options, batch=plan.batch, results=[result])


@pytest.fixture
def refused(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", db_url)
    write(db_url, "orders", [1, 2, 3], ["eu", None, "us"])  # 2: null routing key
    write(db_url, "refunds", [3, 4], ["us", "eu"])  # 3: held by orders
    return db_url


def test_outbox_rejects_lists_bad_rows_and_conflicts_with_their_reasons(
    refused: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["rejects"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].split()[2:4] == ["refunds:1", "3"]  # newest first
    assert "is held by a row of batch orders:1 with another sink, body" in out[0]
    assert out[1].split()[2:4] == ["orders:1", "2"] and "region is null" in out[1]
    assert main(["rejects", "--batch", "orders:1", "--json"]) == 0
    (only,) = json.loads(capsys.readouterr().out)
    assert (only["message_id"], only["reason"]) == ("2", "region is null")
    assert json.loads(only["row_json"])["payload"] == "orders 2"
    assert main(["batches"]) == 0  # each batch's line counts its rejects
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert lines["batch"][-3:] == ["rejected", "last", "confirmed"]
    assert lines["orders:1"][1] == "2" and lines["orders:1"][-2] == "1"
    assert lines["refunds:1"][1] == "1" and lines["refunds:1"][-2] == "1"
    assert main(["rejects", "--batch", "nope:1"]) == 0
    assert capsys.readouterr().out.strip() == "no rows refused by the Spark writer in batch nope:1"


async def test_get_v1_rejects_pages_newest_first(refused: str) -> None:
    engine = make_engine(refused)
    app = create_app(settings_for(refused), engine=engine)
    async with client_for(app) as client:
        first = await client.get("/v1/rejects", params={"limit": 1}, headers=R)
        assert first.status_code == 200, first.text
        body = first.json()
        assert [r["message_id"] for r in body["items"]] == ["3"]
        assert body["next_before"] == body["items"][0]["id"]
        rest = await client.get("/v1/rejects", params={"before": body["next_before"]}, headers=R)
        assert [r["message_id"] for r in rest.json()["items"]] == ["2"]
        one = await client.get("/v1/rejects", params={"batch_id": "refunds:1"}, headers=R)
        assert [r["sink"] for r in one.json()["items"]] == ["refunds"]
        bad = await client.get("/v1/rejects", params={"limit": 0}, headers=R)
        assert bad.status_code == 422
        assert bad.headers["content-type"].startswith("application/problem+json")
        denied = await client.get("/v1/rejects")
        assert denied.status_code == 401
    engine.dispose()
