"""Log lines: text or JSON, timestamps, never a password."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

from app.logs import configure, redact


def test_passwords_in_urls_are_redacted_anywhere_in_a_line() -> None:
    line = "cannot reach postgresql+psycopg://outbox:s3cr@t@db:5432/x nor amqps://u:p%40ss@mq/"
    assert (
        redact(line)
        == "cannot reach postgresql+psycopg://outbox:***@db:5432/x nor amqps://u:***@mq/"
    )


def test_secrets_in_query_strings_are_redacted() -> None:
    line = (
        '127.0.0.1:5000 - "GET /ui?x=1&access_token=s3cret-token HTTP/1.1" 422 '
        '"GET /v1/stats?TOKEN=abc;password=pw#f" '
        '"GET /v1/keys/parked?ordering_key=k"'
    )
    assert redact(line) == (
        '127.0.0.1:5000 - "GET /ui?x=1&access_token=*** HTTP/1.1" 422 '
        '"GET /v1/stats?TOKEN=***;password=***#f" '
        '"GET /v1/keys/parked?ordering_key=k"'
    )


def _emit(fmt: str) -> str:
    stream = io.StringIO()
    configure(level="info", fmt=fmt, stream=stream)  # type: ignore[arg-type]
    try:
        logging.getLogger("app.publisher").info(
            "connected to %s", "amqp://guest:guest@127.0.0.1:5673/", extra={"channels": 2}
        )
        logging.getLogger("app.publisher").debug("not shown at INFO")
    finally:
        configure(level="WARNING")
    return stream.getvalue()


def test_text_lines_carry_time_level_logger_and_extras() -> None:
    (line,) = _emit("text").splitlines()
    assert line.endswith(
        "INFO    app.publisher: connected to amqp://guest:***@127.0.0.1:5673/ channels=2"
    )
    assert line[:4].isdigit() and "Z " in line


def test_json_lines_are_one_object_each() -> None:
    (line,) = _emit("json").splitlines()
    doc = json.loads(line)
    assert (doc["level"], doc["logger"], doc["channels"]) == ("INFO", "app.publisher", 2)
    assert doc["message"] == "connected to amqp://guest:***@127.0.0.1:5673/"
    assert doc["ts"].endswith("Z")


def test_a_value_with_a_newline_cannot_forge_a_text_line() -> None:
    """Issue 48: a message id with a newline, quoted by the consumer kit's log line, wrote a
    second, forged line in the text format. Every record is one line: its line breaks and other
    control characters are written escaped (JSON lines were one object each already)."""
    stream = io.StringIO()
    configure(level="INFO", fmt="text", stream=stream)
    try:
        forged = "m-1\n2026-11-29T00:00:00.000Z INFO    app.api: operator admin signed in"
        logging.getLogger("app.consumer").warning(
            "message %r failed", forged, extra={"key": "a\r\nb"}
        )
        logging.getLogger("app.consumer").warning("message %s failed\x1b[2K\u2028tab\there", forged)
    finally:
        configure(level="WARNING")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert "m-1\\n2026-11-29" in lines[1] and "\\x1b[2K\\u2028tab\there" in lines[1]
    assert lines[0].endswith("key=a\\r\\nb")


def test_a_secret_of_the_process_is_masked_under_any_name() -> None:
    """Issue 48, item 7: a token in a query parameter of any other name (``?t=...``, a path, a
    header echoed in an error) reached the log verbatim; only ``access_token=`` and its kin were
    masked. The API registers its tokens and session key: masked wherever they appear."""
    from app.logs import add_secrets

    token = "op-" + "k" * 40
    add_secrets(token, "short", None)
    line = redact(f'GET /v1/stats?t={token}&x=1 HTTP/1.1" 401 and again {token[:-1]} {token}')
    assert token not in line and line.count("***") == 2
    assert token[:-1] in line  # a shorter string is not the secret
    assert redact("short") == "short"  # too short to mask without masking everything


def test_the_api_masks_its_own_tokens_in_every_log_line(tmp_path: Path) -> None:
    from app.api import create_app
    from app.logs import TextFormatter
    from app.settings import Settings

    read, operator = "read-Gm4Tq8Wz2Lc6Xv9Bn3Kd7Rp5Hy1Fs0", "oper-Nc2Lq7Vw4Tz9Xm5Kd8Bh3Rp6Gy1Fs0"
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'o.db'}",
        api_token=read,
        operator_token=operator,
    )
    create_app(settings)
    record = logging.makeLogRecord(
        {"name": "uvicorn.access", "levelno": 20, "levelname": "INFO", "msg": "%s"}
    )
    record.args = (f"GET /v1/stats?key={read}&op={operator}",)
    line = TextFormatter().format(record)
    assert read not in line and operator not in line and line.count("***") == 2
