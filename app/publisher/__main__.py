"""``python -m app.publisher [--until-empty]``: the publisher, configured from ``OUTBOX_*``."""

from __future__ import annotations

import logging
import sys

from app.publisher import main
from app.settings import Settings


def _cli(argv: list[str]) -> int:
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    stats = main(Settings(), until_empty="--until-empty" in argv)
    print(stats, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
