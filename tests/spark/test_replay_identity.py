"""Replay-stable identity: a micro-batch replayed after the driver died (``kill -9``), on another
parallelism and another input split, adds no row and drops none.

The condition the guarantee rests on (docs/guarantees.md): a replay reads the same multiset of
rows, which Spark guarantees for replayable sources (files, Kafka offsets in the checkpoint). Ids
are then the key column's value, or derived from the row's content and its occurrence among
identical rows of the batch: never from its partition or position.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import dbview

pytestmark = [pytest.mark.spark, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
FILES, PER_FILE, COPIES = 4, 500, 3  # every 50th row appears COPIES times, all identical


def write_input(directory: Path) -> list[dict[str, object]]:
    directory.mkdir(parents=True)
    rows = []
    for f in range(FILES):
        chunk = []
        for i in range(PER_FILE):
            n = f * PER_FILE + i
            row = {"id": n, "region": f"r{n % 3}", "payload": f"order {n}"}
            chunk += [row] * (COPIES if n % 50 == 0 else 1)
        (directory / f"part-{f}.json").write_text("\n".join(json.dumps(r) for r in chunk) + "\n")
        rows += chunk
    return rows


def drive(
    url: str, src: Path, cp: Path, *, threads: int, max_bytes: str, key: str, kill_at: int
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    argv = [
        sys.executable,
        "-m",
        "tests.spark.replay_driver",
        url,
        str(src),
        str(cp),
        str(threads),
        max_bytes,
        key,
        str(kill_at),
    ]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("kill_at", "key"),
    [
        # on every PySpark: ids derived from content, read again on another parallelism
        pytest.param(
            "first-partition", "", id="first-partition-derived-ids", marks=pytest.mark.spark_api
        ),
        pytest.param("first-partition", "id", id="first-partition-key-column"),
        pytest.param("all-partitions", "", id="all-partitions-derived-ids"),
        pytest.param("all-partitions", "id", id="all-partitions-key-column"),
    ],
)
def test_a_replay_after_kill_9_on_other_parallelism_writes_every_row_exactly_once(
    pg_url: str, tmp_path: Path, key: str, kill_at: str
) -> None:
    rows = write_input(tmp_path / "in")
    expected = rows if not key else list({r["id"]: r for r in rows}.values())
    cp = tmp_path / "checkpoint"
    # One thread and small splits: many partitions, committed one after another; the driver
    # dies after the first partition's commit, or after the last one's (before the batch is
    # recorded and before Spark logs the micro-batch as done).
    mark = 1 if kill_at == "first-partition" else len(expected)
    killed = drive(pg_url, tmp_path / "in", cp, threads=1, max_bytes="8192", key=key, kill_at=mark)
    assert killed.returncode == -9, killed.stderr[-3000:]
    before = dbview.counts(pg_url)
    assert before["outbox_batches"] == 0
    assert 0 < before["outbox"] <= len(expected)
    if kill_at == "all-partitions":
        assert before["outbox"] == len(expected)
    else:
        assert before["outbox"] < len(expected)

    # The same checkpoint, another parallelism and input split: Spark replays micro-batch 0.
    again = drive(pg_url, tmp_path / "in", cp, threads=3, max_bytes="134217728", key=key, kill_at=0)
    assert again.returncode == 0, again.stderr[-3000:]
    stored = dbview.outbox(pg_url)
    assert collections.Counter(r["body"].decode() for r in stored) == collections.Counter(
        str(r["payload"]) for r in expected
    )
    assert len({r["message_id"] for r in stored}) == len(stored) == len(expected)
    # the batch's rows as Spark read them (with a key column, identical rows are one message)
    assert [(b["batch_id"], b["row_count"]) for b in dbview.batches(pg_url)] == [
        ("replay:0", len(rows))
    ]
