"""Pagination cursors and pages of the read side: pure, standard library only.

A cursor is the keyset position a reader hands back, as URL-safe base64 of a small JSON
object; anything else is a :class:`BadCursor`, which the REST API answers with a 422.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

MAX_ROW_ID = 2**63 - 1
T = TypeVar("T")


class BadCursor(ValueError):
    """A pagination cursor that the read side did not produce (or that was tampered with)."""


def plain_text(value: str, *, max_length: int = 1024) -> bool:
    """Whether ``value`` can be stored and compared by both backends: bounded, no NUL byte,
    valid UTF-8 (no lone surrogates)."""
    if len(value) > max_length or "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def encode_cursor(payload: dict[str, Any]) -> str:
    raw = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> dict[str, Any]:
    """The payload of a cursor made by :func:`encode_cursor`; :class:`BadCursor` otherwise."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        payload = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError) as exc:  # RecursionError: deep nesting
        raise BadCursor("not a cursor returned by this endpoint") from exc
    if not isinstance(payload, dict):
        raise BadCursor("not a cursor returned by this endpoint")
    return payload


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None
