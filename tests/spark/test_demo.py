"""The main job (`make demo`) end to end: JSON -> Spark stream -> outbox -> RabbitMQ -> consumer."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr
from rich.console import Console

from app.demo import print_summary, run_demo
from app.settings import Settings

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_demo_confirms_and_delivers_every_row(
    backend: str, request: pytest.FixtureRequest, amqp_url: str, tmp_path: Path, spark: object
) -> None:
    db_url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    settings = Settings(database_url=SecretStr(db_url), amqp_url=SecretStr(amqp_url))
    console = Console(file=(tmp_path / "out.txt").open("w"), width=100)
    report = run_demo(settings, rows=600, files=2, workdir=tmp_path / "demo", console=console)
    print_summary(report, settings, console)
    assert report.written == 600
    assert report.statuses == {"confirmed": 600}
    assert report.received == 600 and report.missing == 0
    assert report.ok
    assert (report.batches, report.spark_confirmed, report.spark_undelivered) == (2, 600, 0)
    out = (tmp_path / "out.txt").read_text()
    assert "OK: every row confirmed and received" in out
    assert "confirmed, as the Spark job saw it (2 batches waited)" in out
    assert len(report.spark_progress) == 2, report.spark_progress
    assert all(
        "0 returned, 0 nacked, 0 failed, 0 skipped, 0 open" in line
        for line in report.spark_progress
    )
    again = run_demo(settings, rows=300, files=1, workdir=tmp_path / "demo", console=console)
    assert again.ok and again.written == 300, "a second run must work (its own event ids)"
