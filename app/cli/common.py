"""What every command shares: exit codes, errors, argument types, JSON output."""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import math
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Engine

from app.db import make_engine
from app.outbox.actions import MAX_ACTOR, has_control_characters
from app.settings import Settings

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
N = TypeVar("N", int, float)


#: republish moved some of the matching rows and left the rest (its --limit)
EXIT_PARTIAL = 3


MAX_REPUBLISH_LIMIT = 100_000


class UsageError(Exception):
    """The command line or the configuration is wrong (exit code 2)."""


class Failure(Exception):
    """The command could not do its job (exit code 1)."""


def engine_of(settings: Settings) -> Engine:
    return make_engine(settings.database_url.get_secret_value())


@contextmanager
def database(settings: Settings) -> Iterator[Engine]:
    """An engine for one command, disposed of when the command is done with it."""
    engine = engine_of(settings)
    try:
        yield engine
    finally:
        engine.dispose()


def print_json(value: object) -> None:
    import json

    print(json.dumps(value, indent=2, default=str))


def json_compact(value: object) -> str:
    import json

    return json.dumps(value, separators=(",", ":"), default=str)[:120]


def timestamp(text: str) -> dt.datetime:
    try:
        stamp = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return stamp.replace(tzinfo=dt.UTC) if stamp.tzinfo is None else stamp.astimezone(dt.UTC)


def _number(text: str, kind: Callable[[str], N], what: str) -> N:
    """``text`` read as ``kind``; an argument error saying it is not ``what`` otherwise."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def metrics_flags(parser: argparse.ArgumentParser, *, when: str = "") -> None:
    """``--metrics-port`` and ``--metrics-host``: a long-running command's own probes."""
    parser.add_argument(
        "--metrics-port",
        type=bounded_int(0, 65535),
        default=None,
        help=f"{when}serve /metrics, /healthz, /readyz on this port (0: any free one)",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _number(text, int, "a whole number")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be within {low}..{high}, got {value}")
        return value

    return parse


def bounded_float(low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _number(text, float, "a number")
        if not low <= value <= high:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"must be within {low:g}..{high:g}, got {text!r}")
        return value

    return parse


def positive_days(text: str) -> float:
    days = _number(text, float, "a number of days")
    if not math.isfinite(days) or days <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive, finite number of days, got {text!r} (a purge never deletes "
            "rows confirmed just now)"
        )
    return days


def positive_seconds(text: str) -> float:
    value = _number(text, float, "a number of seconds")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds: {text!r}")
    return value


def one_line(most: int) -> Callable[[str], str]:
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


def stream_name(text: str) -> str:
    """A stream filter: a name RabbitMQ takes for a stream (as the API checks it)."""
    from app.streams.names import StreamNameError, check_stream_name

    try:
        return check_stream_name(text)
    except StreamNameError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"[:MAX_ACTOR]


Sub = Any  # argparse's _SubParsersAction is private


def json_flag(parser: argparse.ArgumentParser, like: str | None = None, *, what: str = "") -> None:
    """``--json``: the command's answer as JSON, ``like`` the REST call that answers the same."""
    shape = f" (like {like})" if like else ""
    parser.add_argument("--json", action="store_true", help=f"{what or 'as JSON'}{shape}")


def actor_flag(parser: argparse.ArgumentParser, who: str = "who acts") -> None:
    """``--actor``: who the audit row names (default the CLI user at this host)."""
    parser.add_argument(
        "--actor", type=one_line(MAX_ACTOR), default=default_actor(), help=f"{who} (audit row)"
    )
