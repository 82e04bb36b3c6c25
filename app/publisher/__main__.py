"""``python -m app.publisher [--until-empty]``: the publisher, configured from ``OUTBOX_*``."""

from __future__ import annotations

import sys

from app.db import SchemaMismatch
from app.logs import configure
from app.publisher.service import main
from app.settings import Settings


def _cli(argv: list[str]) -> int:
    settings = Settings()
    configure(level=settings.log_level, fmt=settings.log_format)
    try:
        stats = main(settings, until_empty="--until-empty" in argv)
    except SchemaMismatch as exc:
        print(f"outbox publish: {exc}", file=sys.stderr, flush=True)
        return 2
    print(stats, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
