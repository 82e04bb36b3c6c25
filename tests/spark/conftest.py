"""One local SparkSession for the whole run (Spark starts slowly), with ``format("outbox")``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from spark_writer import register_data_source


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """``local[2,2]``: two threads, and a failed task is retried once (``local[2]`` never
    retries), so the retry tests see a real second attempt."""
    tmp: Path = tmp_path_factory.mktemp("spark")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYSPARK_PYTHON", sys.executable)  # executor workers use the venv too
        mp.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
        session = (
            SparkSession.builder.master("local[2,2]")
            .appName("outbox-spark-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.sql.warehouse.dir", str(tmp / "warehouse"))
            .config("spark.local.dir", str(tmp / "local"))
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("ERROR")
        register_data_source(session)
        yield session
        session.stop()
