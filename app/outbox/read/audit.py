"""The operators' audit log, newest first (``GET /v1/audit``, ``outbox audit``, the console's
audit page and a message's history).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, select

from app.outbox.read.sql import as_dict, from_row
from app.outbox.schema import audit


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    at: dt.datetime
    actor: str
    action: str
    request_id: str | None
    filter: dict[str, Any]
    count: int


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    at: dt.datetime
    actor: str
    principal: str | None
    client_addr: str | None
    action: str
    request_id: str | None
    filter: dict[str, Any]
    count: int


def audit_trail(engine: Engine, *, limit: int = 50, before: int | None = None) -> list[AuditEntry]:
    """Operator actions, newest first (keyset pages: ``before`` the last id of the previous)."""
    stmt = select(audit).order_by(audit.c.id.desc()).limit(limit)
    if before is not None:
        stmt = stmt.where(audit.c.id < before)
    with engine.connect() as conn:
        rows = conn.execute(stmt).mappings().all()
    return [from_row(AuditEntry, r, filter=as_dict(r["filter"]) or {}) for r in rows]


def audit_by_request_id(engine: Engine, *, request_id: str) -> AuditRecord | None:
    stmt = select(audit).where(audit.c.request_id == request_id)
    with engine.connect() as conn:
        row = conn.execute(stmt).mappings().first()
    if row is None:
        return None
    return from_row(AuditRecord, row, filter=dict(row["filter"] or {}))
