"""What every command shares: exit codes, errors, argument types, JSON output."""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import math
import socket
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from app.cli_output import cell
from app.db import make_engine
from app.outbox.actions import MAX_ACTOR, has_control_characters
from app.settings import Settings

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


#: republish moved some of the matching rows and left the rest (its --limit)
EXIT_PARTIAL = 3


MAX_REPUBLISH_LIMIT = 100_000


class UsageError(Exception):
    """The command line or the configuration is wrong (exit code 2)."""


class Failure(Exception):
    """The command could not do its job (exit code 1)."""


_cell = cell


def _engine(settings: Settings) -> Engine:
    return make_engine(settings.database_url.get_secret_value())


def _json(value: object) -> None:
    import json

    print(json.dumps(value, indent=2, default=str))


def json_compact(value: object) -> str:
    import json

    return json.dumps(value, separators=(",", ":"), default=str)[:120]


def _timestamp(text: str) -> dt.datetime:
    try:
        stamp = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return stamp.replace(tzinfo=dt.UTC) if stamp.tzinfo is None else stamp.astimezone(dt.UTC)


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be within {low}..{high}, got {value}")
        return value

    return parse


def _positive_days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if not math.isfinite(days) or days <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number of days, got {text!r} (a purge never deletes "
            "rows confirmed just now)"
        )
    return days


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds: {text!r}")
    return value


def _line(most: int) -> Callable[[str], str]:
    """A text kept in the audit trail: one line of 1 to ``most`` characters, no control
    characters (they would forge lines in logs and tables), as the API checks it."""

    def check(text: str) -> str:
        value = text.strip()
        if not value or len(value) > most:
            raise argparse.ArgumentTypeError(f"must be 1 to {most} characters, got {len(value)}")
        if has_control_characters(value):
            raise argparse.ArgumentTypeError("must be one line, without control characters")
        return value

    return check


def _default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"[:MAX_ACTOR]


Sub = Any  # argparse's _SubParsersAction is private
