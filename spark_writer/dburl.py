"""Database URLs as the writer's connections read them: SQLAlchemy's forms (what the product's
engines take, so one URL serves every component) turned into libpq's connection strings and
SQLite's paths. Pure: no connection is made here."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from psycopg.conninfo import make_conninfo

from spark_writer.errors import OutboxConfigError


def pg_conninfo(url: str) -> str:
    """``postgresql+psycopg://u:p@h/db`` → ``postgresql://u:p@h/db`` for libpq.

    SQLAlchemy's multi-host form (``postgresql+psycopg://u:p@/db?host=a:5432&host=b:5432&
    target_session_attrs=read-write``, a primary and its standbys) becomes libpq's
    ``host=a,b port=5432,5432 …``, as the product's engines read it: libpq tries the hosts in
    turn and keeps the primary. Passed through as a URI, libpq kept the last ``host=`` alone
    and took ``b:5432`` for a host name."""
    uri = "postgresql://" + url.split("://", 1)[1]
    parts = urlsplit(uri)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    hosts = [value for key, value in pairs if key == "host"]
    if not hosts or not any(":" in h and not h.startswith("/") for h in hosts):
        return uri
    names, ports = [], []
    for host in hosts:
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
        names.append(name or host)
        ports.append(port or str(parts.port or 5432))
    params: dict[str, Any] = {k: v for k, v in pairs if k not in ("host", "port")}
    params.update(host=",".join(names), port=",".join(ports))
    if parts.username:
        params["user"] = unquote(parts.username)
    if parts.password:
        params["password"] = unquote(parts.password)
    if parts.path.strip("/"):
        params["dbname"] = unquote(parts.path.lstrip("/"))
    return make_conninfo("", **params)


def sqlite_path(url: str) -> str:
    """``sqlite:///rel.db`` → ``rel.db``; ``sqlite:////abs/x.db`` → ``/abs/x.db``."""
    parts = url.split(":///", 1)
    path = parts[1].split("?", 1)[0] if len(parts) == 2 else ""
    if not path or path == ":memory:":
        raise OutboxConfigError("SQLite needs a file: sqlite:///PATH (executors open it too)")
    return path
