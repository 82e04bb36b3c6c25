"""The `outbox` command line: one entry point for operators and scripts.

Exit codes: 0 done; 1 operational failure (database unreachable, schema missing, unknown batch);
2 usage error or bad configuration; 3 republish left matching rows behind its --limit.
`status --check` exits 0 OK, 1 WARNING, 2 CRITICAL.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, ProgrammingError

from app.cli import act, inspect, service
from app.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, Failure, UsageError
from app.cli.render import duration, render_stats
from app.db import SchemaMismatch
from app.logs import configure as configure_logging
from app.logs import redact
from app.settings import Settings

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "duration",
    "main",
    "render_stats",
]


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (and exit code 2), with where to look for help."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="outbox",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Settings come from OUTBOX_* environment variables (see the README).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (service, inspect, act):
        group.register(sub)
    return parser


def _config_problem(exc: ValidationError) -> str:
    """The fields and messages of a settings error, never the values (they may be secrets)."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]).upper()
        parts.append(f"OUTBOX_{field}: {err['msg']}")
    return "; ".join(parts)


def _db_problem(exc: DBAPIError, *, url: str) -> str:
    first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
    first = _without_password(first, url=url)
    if isinstance(exc, ProgrammingError) or "no such table" in first:
        return f"database schema missing or outdated ({first}): run `outbox migrate`"
    return f"database unavailable: {first}"


def _without_password(text: str, *, url: str) -> str:
    """``text`` without any piece of the URL's password. A password holding an unescaped ``@``
    is split by the URL parser, and the driver's error quotes its tail as a host name."""
    _, _, rest = url.partition("://")
    userinfo, at, _ = rest.rpartition("@")
    _, colon, password = userinfo.partition(":")
    if not (at and colon and password):
        return text
    for piece in sorted({password, *re.split(r"[:@]", password)}, key=len, reverse=True):
        if len(piece) >= 3:
            text = text.replace(piece, "***")
    if "@" in password:
        text += " (write an '@' in the database password as %40)"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    err = sys.stderr
    for arg in given:  # bytes that are not UTF-8 arrive as lone surrogates: no database takes them
        try:
            arg.encode()
        except UnicodeEncodeError:
            try:  # the bytes as given: 'a\xffb'
                raw = arg.encode(errors="surrogateescape")
            except UnicodeEncodeError:
                raw = arg.encode(errors="backslashreplace")
            shown = raw.decode(errors="backslashreplace")
            print(
                f"outbox: the argument '{shown}' is not valid UTF-8 (see `outbox --help`)", file=err
            )
            return EXIT_USAGE
    args = build_parser().parse_args(given)
    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"outbox: bad configuration: {_config_problem(exc)}", file=err)
        return EXIT_USAGE
    configure_logging(level=settings.log_level, fmt=settings.log_format)
    return _run(args, settings, err)


def _run(args: argparse.Namespace, settings: Settings, err: TextIO) -> int:
    try:
        return int(args.func(settings, args))
    except BrokenPipeError:  # `outbox status | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except UsageError as exc:
        print(f"outbox: {exc}", file=err)
        return EXIT_USAGE
    except Failure as exc:
        print(f"outbox: {exc}", file=err)
        return EXIT_FAILURE
    except DBAPIError as exc:
        print(f"outbox: {_db_problem(exc, url=settings.database_url.get_secret_value())}", file=err)
        return EXIT_FAILURE
    except (SchemaMismatch, OSError) as exc:
        print(f"outbox: {redact(str(exc))}", file=err)
        return EXIT_FAILURE
