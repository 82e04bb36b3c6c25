"""The README's Python example runs as written, in a fresh directory."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.spark


def test_readme_python_example_runs_and_is_idempotent(tmp_path: Path) -> None:
    # the example's step 3 writes through format("outbox") (skipped where PySpark lacks it)
    (code,) = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with sqlite3.connect(tmp_path / "outbox.db") as db:
        rows = db.execute("SELECT batch_id, message_id FROM outbox ORDER BY id").fetchall()
        batches = db.execute("SELECT batch_id FROM outbox_batches ORDER BY batch_id").fetchall()
    # order ids are the key of the batch job (1, 2) and of the data source (3); the stream's two
    # rows have content ids
    assert len(rows) == 5 and len({m for _, m in rows}) == 5
    assert {m for b, m in rows if not b.startswith("orders-stream")} == {"1", "2", "3"}
    assert [b for (b,) in batches] == ["orders-daily:20240601", "orders-ds:1", "orders-stream:0"]
