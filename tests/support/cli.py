"""What the CLI tests share: an environment scrubbed of OUTBOX_* with the test database set, its
engine (both fixtures), and running `outbox` in-process with its output captured."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from app.cli import main
from app.db import make_engine


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, db_url: str) -> str:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", db_url)
    return db_url


@pytest.fixture
def engine(env: str) -> Iterator[Engine]:
    eng = make_engine(env)
    yield eng
    eng.dispose()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err
