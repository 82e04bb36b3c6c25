"""Fixtures of the conformance suite: one migrated SQLite file, copied per schedule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.db import migrate


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conformance") / "template.db"
    migrate(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("runs")
