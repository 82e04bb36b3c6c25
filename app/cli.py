"""The ``outbox`` command line: one entry point for operators and scripts."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app.db import migrate
from app.settings import Settings


def _cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    migrate(settings.database_url.get_secret_value(), args.revision)
    print(f"outbox schema at revision {args.revision}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outbox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    mig = sub.add_parser("migrate", help="create or upgrade the outbox schema")
    mig.add_argument("--revision", default="head", help="target alembic revision (default head)")
    mig.set_defaults(func=_cmd_migrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings()
    return int(args.func(settings, args))


if __name__ == "__main__":
    sys.exit(main())
