"""The LISTEN connection reads the database URL as the engine does (issue 49): libpq gets the
connection string SQLAlchemy's psycopg dialect builds, never the URL rendered back."""

from __future__ import annotations

import psycopg

from app.publisher.listener import libpq_conninfo


def _parts(url: str) -> dict[str, object]:
    conninfo = libpq_conninfo(url)
    assert conninfo is not None
    return psycopg.conninfo.conninfo_to_dict(conninfo)


def test_a_multi_host_url_gives_libpq_every_host_in_order() -> None:
    got = _parts(
        "postgresql+psycopg://outbox:s%40cret@/outbox"
        "?host=db-a:5432&host=db-b:6432&target_session_attrs=read-write&connect_timeout=3"
    )
    assert got == {
        "host": "db-a,db-b",
        "port": "5432,6432",
        "dbname": "outbox",
        "user": "outbox",
        "password": "s@cret",
        "target_session_attrs": "read-write",
        "connect_timeout": "3",
    }


def test_a_plain_url_keeps_its_host_port_and_parameters() -> None:
    got = _parts("postgresql://outbox:pw@localhost:5433/outbox?sslmode=require")
    assert got == {
        "host": "localhost",
        "port": "5433",
        "dbname": "outbox",
        "user": "outbox",
        "password": "pw",
        "sslmode": "require",
    }


def test_sqlite_has_no_listener() -> None:
    assert libpq_conninfo("sqlite:///outbox.db") is None
