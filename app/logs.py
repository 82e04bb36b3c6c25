"""Logging for every ``outbox`` command: level and format from settings, secrets never shown.

``OUTBOX_LOG_LEVEL`` (default INFO) and ``OUTBOX_LOG_FORMAT`` (``text`` or ``json``). Text lines
carry an ISO timestamp, the level, the logger and the message; JSON lines carry the same as fields
(plus any ``extra`` values a call passed, and the exception when there is one), one object per
line, for log shippers. Every record's text goes through :func:`redact`, so a URL with a password
that reaches a log line anyway (an exception text quoting it) loses the password, and a token in
a query string (uvicorn's access lines go through the same handler) loses its value.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
#: ``scheme://user:password@host``: the password runs to the LAST ``@`` before the host, since
#: passwords with an unescaped ``@`` are common and were partly printed before.
_PASSWORD_IN_URL = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):\S*@(?=[^@/\s]*(?:[/\s?#]|$))",
    re.IGNORECASE,
)
#: A secret in a query string (``?access_token=…`` in an access log line): the value goes.
_SECRET_IN_QUERY = re.compile(
    r"(?P<name>[?&;](?:access_token|token|api_key|apikey|password|secret|session)=)[^&;#\s\"]*",
    re.IGNORECASE,
)
_STANDARD = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


#: Secrets this process holds (the API's tokens, its session key), masked wherever they appear:
#: a token sent in a query parameter of any other name (``?t=…``) reached the access log
#: verbatim (issue 48). Only values of 12 characters or more (shorter ones are refused anyway).
_SECRETS: set[str] = set()
_SECRETS_RE: re.Pattern[str] | None = None


def add_secrets(*values: str | None) -> None:
    """Mask these values in every log line from now on (``***``)."""
    global _SECRETS_RE
    _SECRETS.update(v for v in values if v and len(v) >= 12)
    if _SECRETS:
        longest_first = sorted(_SECRETS, key=len, reverse=True)
        _SECRETS_RE = re.compile("|".join(re.escape(v) for v in longest_first))


def redact(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host`` and ``?access_token=x`` ->
    ``?access_token=***``, anywhere in ``text``; and every value of :func:`add_secrets`."""
    text = _PASSWORD_IN_URL.sub(r"\g<scheme>\g<user>:***@", text)
    if _SECRETS_RE is not None:
        text = _SECRETS_RE.sub("***", text)
    return _SECRET_IN_QUERY.sub(r"\g<name>***", text)


def redact_url(url: str) -> str:
    """A URL fit for a log line or an error message (no password)."""
    return redact(url)


def _utc(record: logging.LogRecord) -> str:
    stamp = dt.datetime.fromtimestamp(record.created, dt.UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


#: Line breaks and the other C0 controls (and DEL, and the C1 line breaks), written escaped in a
#: text line: a value a record quotes (a message id, a routing key, a broker's reply text) can
#: come from anyone who writes a row, and a newline in it forged a whole log line (issue 48).
_CONTROLS = {
    **{c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, 0x85] if c != 0x09},  # a tab stays
    0x0A: "\\n",
    0x0D: "\\r",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def first_line(exc: BaseException) -> str:
    """An exception as ``Type: its first line`` (a driver's error can run to many lines)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def one_line(text: str) -> str:
    """``text`` with its line breaks and control characters escaped: one log line, always."""
    return text.translate(_CONTROLS)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{_utc(record)} {record.levelname:<7} {record.name}: {one_line(record.getMessage())}"
        )
        extra = _extra(record)
        if extra:
            line += " " + " ".join(f"{k}={one_line(str(v))}" for k, v in extra.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_extra(record),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return redact(json.dumps(doc, default=str, ensure_ascii=False))


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the given stream, or to whatever ``sys.stderr`` is when a record comes."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(stream or sys.stderr)
        self._follow = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self._follow:
            self.stream = sys.stderr
        super().emit(record)


def configure(
    *, level: str = "INFO", fmt: LogFormat = "text", stream: TextIO | None = None
) -> None:
    """Set up the root logger for a command (replaces a handler set up here before, and leaves
    handlers others installed alone)."""
    handler = _Handler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("aiormq", "aio_pika", "py4j", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
