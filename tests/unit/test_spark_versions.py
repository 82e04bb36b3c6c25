"""What a user on an older PySpark is told when they reach for ``format("outbox")``."""

from __future__ import annotations

import pyspark
import pytest

import spark_writer
from spark_writer.versions import DATA_SOURCE_SINCE, unsupported_data_source


def test_the_version_gate_names_what_is_needed_and_what_works() -> None:
    register = unsupported_data_source(ImportError("No module named 'pyspark.sql.datasource'"))
    with pytest.raises(spark_writer.OutboxConfigError) as err:
        register(None)
    text = str(err.value)
    assert f'format("outbox") needs PySpark {DATA_SOURCE_SINCE} or later' in text
    assert f"this is PySpark {pyspark.__version__}" in text
    assert "OutboxSink (foreachBatch) and write_outbox work on this version" in text


def test_the_writers_import_on_this_pyspark() -> None:
    assert callable(spark_writer.OutboxSink) and callable(spark_writer.write_outbox)
    assert callable(spark_writer.register_data_source)


def test_the_data_source_commit_logs_where_nobody_configured_logging() -> None:
    """Spark runs ``format("outbox")``'s commit in a bare Python worker: its line per batch
    must still reach stderr (the driver's log)."""
    import subprocess
    import sys

    pytest.importorskip("pyspark.sql.datasource")
    code = (
        "from spark_writer.datasource import _driver_log\n"
        "from spark_writer.writer import log\n"
        "_driver_log(); _driver_log()\n"
        "log.info('outbox batch ds:1: 3 rows, 3 written')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [line for line in proc.stderr.splitlines() if "outbox batch ds:1" in line]
    assert len(lines) == 1 and "INFO spark_writer: outbox batch ds:1: 3 rows" in lines[0]
