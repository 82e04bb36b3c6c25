"""The README's examples run: every ``$`` command of its console blocks against a real
``outbox serve`` on data shaped like the story it tells, with the shown output checked; and its
Python example in a fresh directory (tests/spark/test_readme_example.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine

from app.db import make_engine
from app.outbox.records import Backoff
from app.outbox.states import Status
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients
from tests.support.serve import free_port

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
READ, OPERATOR = "read-Tz5Kq9Wm2Lc7Xv4Bn8Hd3Rp6Gy1Fs0", "oper-Vh7Lm3Qz9Xc2Kw5Bn8Td4Rp6Gy1Fs0"
#: values that differ from run to run (ids, ages, the publisher's name)
VOLATILE = {"message_id", "publisher", "channel_id", "delivery_tag", "age_seconds"}


def console_steps() -> list[tuple[str, str]]:
    """(command, shown output) for every ``$`` line of the README's console blocks."""
    steps = []
    for block in re.findall(r"```console\n(.*?)```", README, flags=re.S):
        parts = re.split(r"^\$ (.*)$", block, flags=re.M)
        steps += [(parts[i], parts[i + 1].strip()) for i in range(1, len(parts), 2)]
    return steps


def seed_story(engine: Engine) -> None:
    """Batch orders-sink:41 in flight with recorded tags; batch orders-sink:42 nacked for good."""
    repo = OutboxClients(engine)
    add_rows(
        engine, n=3, batch_id="orders-sink:41", prefix="orders-sink:41", sep=":", exchange="orders"
    )
    rows = repo.store.claim(owner="vm:2112:a7989a", limit=3, lease_seconds=300)
    repo.store.record_published(
        owner="vm:2112:a7989a", channel_id=1, tags=[(r.id, i + 1) for i, r in enumerate(rows)]
    )
    add_rows(
        engine,
        n=5,
        batch_id="orders-sink:42",
        prefix="orders-sink:42",
        sep=":",
        exchange="orders",
        max_attempts=1,
    )
    nacked = repo.store.claim(owner="p", limit=5, lease_seconds=30)
    repo.store.retry(
        owner="p",
        ids=[r.id for r in nacked],
        error="nacked by the broker",
        backoff=Backoff(),
        exhausted=Status.NACKED,
    )


@pytest.fixture
def api(sqlite_url: str) -> Iterator[str]:
    engine = make_engine(sqlite_url)
    seed_story(engine)
    engine.dispose()
    port = free_port()
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": sqlite_url,
        "OUTBOX_API_TOKEN": READ,
        "OUTBOX_OPERATOR_TOKEN": OPERATOR,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail(f"outbox serve did not come up: {proc.stderr}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def strip_volatile(value: object) -> object:
    if isinstance(value, dict):
        return {k: strip_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [strip_volatile(v) for v in value]
    return value


def test_readme_console_session_runs_and_shows_what_it_says(api: str) -> None:
    steps = console_steps()
    assert len(steps) >= 6, "the README lost its operator session"
    env = {**os.environ, "API": api, "OUTBOX_API_TOKEN": READ, "OUTBOX_OPERATOR_TOKEN": OPERATOR}
    for command, shown in steps:
        proc = subprocess.run(
            ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0, f"{command}\n{proc.stderr}"
        got = json.loads(proc.stdout)
        assert strip_volatile(got) == strip_volatile(json.loads(shown)), shlex.split(command)[-1]
