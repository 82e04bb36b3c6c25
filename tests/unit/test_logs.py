"""Log lines: text or JSON, timestamps, never a password."""

from __future__ import annotations

import io
import json
import logging

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
