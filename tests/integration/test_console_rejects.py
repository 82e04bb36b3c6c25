# ruff: noqa: F811 (the console's fixtures, imported from tests.support.console, are parameters)
"""The Spark writer's rejects in the console (issue #28), in a real Chromium against a real
``uvicorn`` over a real PostgreSQL: the rows are refused by the product's own task function
(``write_partition`` in reject mode, no SparkSession needed), the page counts them by reason
(numbers aside) and lists them newest first, escaped; the overview and the batch link there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType
from selenium import webdriver
from selenium.webdriver.common.by import By
from sqlalchemy import Engine, func, select

from app.outbox.schema import rejects
from spark_writer import OutboxOptions
from spark_writer.envelope import BatchRef
from spark_writer.writer import WritePlan, commit_batch, write_partition
from tests.support.api import READ, Clock
from tests.support.console import (  # noqa: F401 (fixtures)
    Server,
    browser,
    clock,
    engine,
    shot,
    sign_in,
    text,
)

pytestmark = pytest.mark.browser

SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("region", StringType()),
        StructField("payload", StringType()),
    ]
)
HOSTILE = "<script>alert(1)</script>"


def write(url: str, sink: str, number: int, rows: dict[int, tuple[str | None, str]]) -> None:
    options = OutboxOptions(
        url=url,
        sink=sink,
        exchange="x",
        routing_key_column="region",
        body_column="payload",
        message_id_column="id",
        on_invalid="reject",
        max_body_bytes=64,
    )
    batch = BatchRef(sink=sink, spark_batch_id=number)
    plan = WritePlan(options=options, schema=SCHEMA, batch=batch)
    arrow = pa.RecordBatch.from_pydict(
        {
            "id": list(rows),
            "region": [r for r, _ in rows.values()],
            "payload": [p for _, p in rows.values()],
        }
    )
    result = write_partition([arrow], plan=plan, partition=0, attempt=0)
    commit_batch(options=options, batch=batch, results=[result])


@pytest.fixture
def server(pg_url: str, engine: Engine, clock: Clock) -> Iterator[Server]:
    with Server(engine, pg_url, clock) as srv:
        yield srv


def test_writer_rejects_by_reason_and_newest_first(
    browser: webdriver.Chrome, server: Server, engine: Engine, pg_url: str, tmp_path: Path
) -> None:
    write(pg_url, "orders", 1, {1: ("eu", "ok"), 2: (None, HOSTILE), 3: ("eu", "x" * 100)})
    write(pg_url, "orders", 2, {4: ("eu", "y" * 200), 5: (None, "z"), 6: ("us", "fine")})
    write(pg_url, "refunds", 1, {1: ("eu", "another body")})  # id 1 is held by orders:1
    with engine.connect() as conn:
        stored = conn.execute(select(func.count()).select_from(rejects)).scalar_one()
    assert stored == 5

    sign_in(browser, server, READ, "/ui")
    assert text(browser, "rejects") == "5: see them by reason"
    browser.find_element(By.CSS_SELECTOR, "#rejects a").click()
    assert browser.current_url == server.base + "/ui/rejects"
    assert text(browser, "reject-totals") == "5 rows refused in 3 batches, for 3 reasons."
    reasons = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")[:2]]
        for tr in browser.find_elements(By.CSS_SELECTOR, "#reject-reasons tr.reason")
    ]
    assert reasons[:2] == [
        ["2", "body is N bytes, over the N-byte maximum"],
        ["2", "region is null"],
    ], reasons
    assert reasons[2][0] == "1" and "is held by a row of batch orders:N" in reasons[2][1]
    listed = [
        tr.find_elements(By.TAG_NAME, "td")[1].text
        for tr in browser.find_elements(By.CSS_SELECTOR, "#rejects tr.reject")
    ]
    assert listed == ["refunds:1", "orders:2", "orders:2", "orders:1", "orders:1"]
    assert HOSTILE in browser.find_element(By.ID, "rejects").text  # shown as text
    assert not browser.find_elements(By.CSS_SELECTOR, "#rejects script")
    shot(browser, "rejects", tmp_path)

    browser.get(server.base + "/ui/batches/orders%3A1")
    browser.find_element(By.ID, "batch-rejects").click()
    assert text(browser, "reject-totals") == "2 rows refused in 1 batch, for 2 reasons."
    listed = browser.find_elements(By.CSS_SELECTOR, "#rejects tr.reject")
    assert {tr.find_elements(By.TAG_NAME, "td")[2].text for tr in listed} == {"2", "3"}
