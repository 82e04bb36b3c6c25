"""Secrets from files: ``OUTBOX_<NAME>_FILE`` read through the real environment source, the way a
mounted Kubernetes or Docker secret and a systemd credential reach the process."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from app.settings import SECRET_FILES, Settings

VALUES = {
    "database_url": "postgresql+psycopg://outbox:p%40ss-from-file@db:5432/outbox",
    "amqp_url": "amqps://outbox:amqp-secret-from-file@rabbit:5671/",
    "stream_url": "rabbitmq-stream://outbox:stream-secret-from-file@rabbit:5552/",
    "api_token": "read-token-from-a-file-0123456789",
    "operator_token": "operator-token-from-a-file-0123456789",
    "metrics_token": "metrics-token-from-a-file-0123456789",
}


def _secret_file(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name
    path.write_text(content)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("name", SECRET_FILES)
def test_each_secret_is_read_from_its_file(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _secret_file(tmp_path, name, VALUES[name] + "\n")  # `echo secret > file` adds one
    monkeypatch.setenv(f"OUTBOX_{name.upper()}_FILE", str(path))
    value = getattr(Settings(), name)
    assert isinstance(value, SecretStr)
    assert value.get_secret_value() == VALUES[name]


def test_every_secret_has_a_file_variant() -> None:
    secrets = {
        name
        for name, field in Settings.model_fields.items()
        if "SecretStr" in str(field.annotation)
    }
    assert set(SECRET_FILES) <= secrets
    missing = sorted(name for name in secrets if f"{name}_file" not in Settings.model_fields)
    assert not missing, f"secrets readable from the environment only: {missing}"


def test_the_variable_and_its_file_together_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_OPERATOR_TOKEN", "a-forgotten-old-token-0123456789")
    monkeypatch.setenv("OUTBOX_OPERATOR_TOKEN_FILE", str(_secret_file(tmp_path, "op", "new\n")))
    with pytest.raises(ValidationError) as caught:
        Settings()
    message = str(caught.value)
    assert "OUTBOX_OPERATOR_TOKEN or OUTBOX_OPERATOR_TOKEN_FILE, not both" in message
    assert "forgotten" not in message


def test_file_content_is_validated_like_the_variable_without_echoing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _secret_file(tmp_path, "db", "mysql://outbox:hunter2-in-a-file@db/outbox\n")
    monkeypatch.setenv("OUTBOX_DATABASE_URL_FILE", str(path))
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert "sqlite:// or postgresql://" in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("case", ["missing", "empty", "directory"])
def test_an_unusable_file_is_an_error_naming_the_file(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = {
        "missing": tmp_path / "nowhere",
        "empty": _secret_file(tmp_path, "empty", "\n"),
        "directory": tmp_path,
    }[case]
    monkeypatch.setenv("OUTBOX_AMQP_URL_FILE", str(path))
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert "OUTBOX_AMQP_URL_FILE: " in str(caught.value)
    assert str(path) in str(caught.value)
