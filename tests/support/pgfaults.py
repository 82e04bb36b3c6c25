"""A PostgreSQL database that refuses connections, for the tests of what survives that."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import make_url, text

from app.db import make_engine


@contextlib.contextmanager
def database_refusing(admin_url: str, db_url: str) -> Iterator[None]:
    """PostgreSQL refuses the connections to ``db_url``'s database (``ALLOW_CONNECTIONS
    false``) and ends every open one, until the block exits. ``admin_url``: the server's
    administrative URL (the suite's ``service_urls["pg"]``)."""
    admin = make_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = make_url(db_url).database
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false'))
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :d AND pid <> pg_backend_pid()"
                ),
                {"d": name},
            )
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true'))
        admin.dispose()
