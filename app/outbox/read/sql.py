"""Pieces of SQL that more than one reader's queries share: the set-aside statuses, when an
in-flight row was sent and since when it waits, one snapshot for several statements,
timestamps and JSON documents as read back from either backend, and a record from a row.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import ColumnElement, Connection, Engine, case, func

from app.outbox.content import ContentError, load_document
from app.outbox.schema import outbox
from app.outbox.shown import MAX_SHOWN_DOCUMENT
from app.outbox.states import Status

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")

#: Set aside: terminal failures and skipped rows (the partial index ``ix_outbox_aside``).
ASIDE = (Status.RETURNED, Status.NACKED, Status.FAILED, Status.SKIPPED)


def from_row(record: type[R], row: Mapping[Any, Any], **given: Any) -> R:
    """A ``record`` (a dataclass) with each field not ``given`` read from the column of that
    name in ``row``, as the database returned it."""
    names = [f.name for f in dataclasses.fields(record) if f.name not in given]
    return record(**{name: row[name] for name in names}, **given)


def sent_at() -> ColumnElement[dt.datetime]:
    """When the publish of the current attempt went out: only rows with a delivery tag have one
    (a claim clears the tag but keeps the previous attempt's ``published_at``)."""
    return case((outbox.c.delivery_tag.is_not(None), outbox.c.published_at), else_=None)


def held_since() -> ColumnElement[dt.datetime]:
    """Since when an in-flight row waits: its publish, or its claim while not yet sent (the
    broker blocks the publisher, say): a row claimed and stuck must age too."""
    return func.coalesce(sent_at(), outbox.c.claimed_at)


def as_utc(value: Any) -> dt.datetime:
    """A timestamp out of an aggregate (SQLite hands back the stored text)."""
    stamp = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
    assert isinstance(stamp, dt.datetime)
    return stamp.replace(tzinfo=dt.UTC) if stamp.tzinfo is None else stamp.astimezone(dt.UTC)


def as_dict(value: Any) -> dict[str, Any] | None:
    """A JSON column as an object: producers may have stored anything (a non-object is shown
    wrapped, an unreadable document as the reason)."""
    if isinstance(value, dict):  # already the reason it cannot be shown (shown.marked)
        return value
    try:
        doc = load_document(value, what="document", max_bytes=MAX_SHOWN_DOCUMENT)
    except ContentError as exc:
        return {"unreadable": str(exc)}
    if doc is None or isinstance(doc, dict):
        return doc
    return {"value": doc}


def snapshot(engine: Engine) -> Connection:
    """A connection whose statements all see one snapshot (PostgreSQL's repeatable read; a
    SQLite read transaction is one snapshot already)."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
    return conn
