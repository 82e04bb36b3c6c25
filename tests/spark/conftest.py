"""One local SparkSession for the whole run (Spark starts slowly), with ``format("outbox")``."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from spark_writer import OutboxConfigError, register_data_source

#: Why ``format("outbox")`` is not available on this PySpark (empty: it is).
NO_DATA_SOURCE: list[str] = []


@pytest.fixture(autouse=True)
def skip_data_source_tests_on_old_pyspark(request: pytest.FixtureRequest) -> None:
    """On a PySpark without the data source API (``make test-spark-oldest``), a test that
    writes through ``format("outbox")`` is skipped with the reason; every other test runs."""
    uses_data_source = 'format("outbox")' in inspect.getsource(request.function)
    if uses_data_source and (NO_DATA_SOURCE or not data_source_supported()):
        pytest.skip(NO_DATA_SOURCE[0] if NO_DATA_SOURCE else "no data source API here")


def data_source_supported() -> bool:
    try:
        import pyspark.sql.datasource
    except ImportError:
        return False
    return hasattr(pyspark.sql.datasource, "DataSourceStreamArrowWriter")


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
        try:
            register_data_source(session)
        except OutboxConfigError as exc:  # an older PySpark: the other writers still run
            NO_DATA_SOURCE.append(str(exc))
        yield session
        session.stop()
