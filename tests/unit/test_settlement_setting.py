"""``OUTBOX_SETTLEMENT`` read from the real environment: ``ranges`` needs PostgreSQL, and a value
it does not know is refused, each with the reason a user reads at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.settings import Settings


@pytest.fixture(autouse=True)
def _outbox_env_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def test_rows_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "sqlite:///outbox.db")
    assert Settings(_env_file=None).settlement == "rows"  # type: ignore[call-arg]


def test_ranges_on_postgresql(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql+psycopg://u:p@db:5432/outbox")
    monkeypatch.setenv("OUTBOX_SETTLEMENT", "ranges")
    assert Settings(_env_file=None).settlement == "ranges"  # type: ignore[call-arg]


def test_ranges_on_sqlite_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "sqlite:///outbox.db")
    monkeypatch.setenv("OUTBOX_SETTLEMENT", "ranges")
    with pytest.raises(ValidationError, match="settlement 'ranges' needs PostgreSQL"):
        Settings(_env_file=None)  # type: ignore[call-arg]


def test_an_unknown_settlement_is_refused_naming_the_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql+psycopg://u:p@db:5432/outbox")
    monkeypatch.setenv("OUTBOX_SETTLEMENT", "range")
    with pytest.raises(ValidationError, match="'rows' or 'ranges'"):
        Settings(_env_file=None)  # type: ignore[call-arg]
