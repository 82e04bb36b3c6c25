"""What a reader is shown of a row's values: bounded in bytes whatever the row holds.

Anyone with ``INSERT`` on the outbox can store a reason of 20 million characters, a document of
60 MB or a body of a gigabyte; the publisher can write a broker's long reply. A reader (the REST
API, the console, the CLI) must answer in bounded bytes and read bounded bytes: one such reason
was a 120 MB answer, and four read together took the API to 974 MB. So each text value is cut
**in the database** (``substr``) and read with its length; a value that was cut says so, with the
length it has. Documents are read only when short enough to show whole (a cut document is not a
document); a body is read up to the size the reader asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, Label, LargeBinary, Text, case, cast, func, literal_column

from app.outbox.schema import outbox

#: Most characters of one text value shown: a reason (``last_error``, ``reply_text``, an
#: event's detail), a name (message, batch, exchange, keys), a rejected row.
MAX_SHOWN_TEXT = 8192
#: Most characters of a JSON document (headers, properties, an audit filter) read to be shown:
#: a longer one is shown as unreadable with its length.
MAX_SHOWN_DOCUMENT = 1024 * 1024
#: Most body bytes the API and the console show (``include_body``); the CLI shows a body whole.
MAX_SHOWN_BODY = 1024 * 1024
#: What a cut value's column of lengths is labelled: ``<name>__chars``.
_CHARS = "__chars"


def text_of(column: ColumnElement[Any], *, name: str | None = None) -> list[Label[Any]]:
    """The first :data:`MAX_SHOWN_TEXT` characters of ``column`` and its length in characters,
    for :func:`marked` to say what was cut."""
    label = name or column.key
    assert label is not None
    return [
        func.substr(
            column, literal_column("1"), literal_column(str(MAX_SHOWN_TEXT)), type_=Text
        ).label(label),
        func.length(column).label(label + _CHARS),
    ]


def document_of(column: ColumnElement[Any], *, name: str | None = None) -> list[Label[Any]]:
    """A JSON column as text when it holds at most :data:`MAX_SHOWN_DOCUMENT` characters (else
    NULL), and its length: read through :func:`marked`, a longer one becomes a reason."""
    label = name or column.key
    assert label is not None
    as_text = cast(column, Text)
    size = func.length(as_text)
    return [
        case((size > MAX_SHOWN_DOCUMENT, None), else_=as_text).label(label),
        size.label(label + "__doc" + _CHARS),
    ]


def body_of(column: ColumnElement[bytes], *, limit: int | None) -> Label[bytes]:
    """The body's first ``limit`` bytes (all of it when None)."""
    if limit is None:
        return column.label("body")
    return func.substr(
        column, literal_column("1"), literal_column(str(int(limit))), type_=LargeBinary
    ).label("body")


def kept(column: ColumnElement[Any]) -> ColumnElement[Any]:
    """What an event keeps of a row's reason (``outbox_events.detail``): its first
    :data:`MAX_SHOWN_TEXT` characters (the row keeps the whole reason)."""
    return func.substr(column, literal_column("1"), literal_column(str(MAX_SHOWN_TEXT)), type_=Text)


def kept_reasons() -> list[Label[Any]]:
    """A row's ``last_error`` and ``reply_text`` as an event keeps them (:func:`kept`)."""
    return [
        kept(outbox.c.last_error).label("last_error"),
        kept(outbox.c.reply_text).label("reply_text"),
    ]


def capped_length(column: ColumnElement[Any], cap: int) -> ColumnElement[int]:
    """A value's length as a page counts it: what is shown of it, at most ``cap``."""
    size = func.coalesce(func.length(column), 0)
    return case((size > cap, cap), else_=size)


def cut_mark(shown: str, chars: int) -> str:
    """``shown`` with what a reader must know: it is the start of ``chars`` characters."""
    return f"{shown}… [cut: {chars:,} characters in all, the first {len(shown):,} shown]"


def marked(row: Mapping[Any, Any]) -> dict[str, Any]:
    """A row read with :func:`text_of` / :func:`document_of` columns, as plain values: a cut text
    ends with :func:`cut_mark`, a document too long to show is ``{"unreadable": ...}`` (its
    text is never read), and the length columns are gone."""
    values = dict(row)
    for key in [k for k in values if k.endswith(_CHARS)]:
        chars = values.pop(key)
        if key.endswith("__doc" + _CHARS):
            name = key[: -len("__doc" + _CHARS)]
            if chars is not None and chars > MAX_SHOWN_DOCUMENT:
                values[name] = {
                    "unreadable": f"a document of {chars:,} characters, over the "
                    f"{MAX_SHOWN_DOCUMENT:,} shown"
                }
            continue
        name = key[: -len(_CHARS)]
        shown = values.get(name)
        if isinstance(shown, str) and chars is not None and chars > len(shown):
            values[name] = cut_mark(shown, chars)
    return values
