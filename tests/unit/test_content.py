"""The row content rules (``app.outbox.content``): what a row may hold, and that any input gives a
checked row or a ContentError, never another exception."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.outbox.content import (
    HEADER_NAME_MAX,
    MAX_HEADER_DEPTH,
    ContentError,
    Limits,
    check_headers,
    check_properties,
    check_row,
    load_document,
)

LIMITS = Limits(max_body_bytes=1000, max_header_bytes=2000)


def row(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "exchange": "ex",
        "routing_key": "rk",
        "message_id": "m-1",
        "body": b"{}",
        "content_type": "application/json",
        "headers": None,
        "properties": None,
    }
    return base | kw


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def test_a_plain_row_passes_with_persistent_delivery() -> None:
    checked = check_row(**row(headers='{"tenant": "a", "n": 3}'), limits=LIMITS)
    assert checked.headers == {"tenant": "a", "n": 3}
    assert checked.properties == {"delivery_mode": 2}


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        (nested(MAX_HEADER_DEPTH + 1), "nests deeper"),
        ('"just a string"', "must be a JSON object, got a string"),
        ("[1, 2]", "must be a JSON object, got an array"),
        ("{not json", "not valid JSON"),
        ('{"a": NaN}', "not valid JSON"),
        ('{"a": Infinity}', "not valid JSON"),
        (json.dumps({"k" * (HEADER_NAME_MAX + 1): 1}), "over the AMQP limit of 128"),
        (json.dumps({"x-outbox-id": 1}), "set by the publisher"),
        (json.dumps({"big": 2**64}), "outside 64 bits"),
        (json.dumps({"a": "x" * 3000}), "over the 2000-byte limit"),
        (b"\xff\xfe", "not valid UTF-8"),
    ],
)
def test_bad_headers_are_refused_with_a_reason(headers: object, reason: str) -> None:
    with pytest.raises(ContentError, match=reason):
        check_row(**row(headers=headers), limits=LIMITS)


@pytest.mark.parametrize(
    ("properties", "reason"),
    [
        ("[1]", "must be a JSON object, got an array"),
        ({"prority": 1}, "unknown properties"),
        ({"user_id": "root"}, "unknown properties"),
        ({"priority": 300}, "priority must be one of 0..255"),
        ({"priority": True}, "priority must be one of"),
        ({"delivery_mode": 3}, "delivery_mode must be one of"),
        ({"expiration": "soon"}, "milliseconds as digits"),
        ({"expiration": -5}, "milliseconds as digits"),
        ({"timestamp": "yesterday"}, "epoch seconds or ISO 8601"),
        ({"timestamp": "2026-01-01T00:00:00"}, "epoch seconds or ISO 8601"),  # no timezone
        ({"reply_to": "r" * 256}, "over the AMQP limit of 255"),
    ],
)
def test_bad_properties_are_refused_with_a_reason(properties: object, reason: str) -> None:
    with pytest.raises(ContentError, match=reason):
        check_row(**row(properties=properties), limits=LIMITS)


@pytest.mark.parametrize("depth", [3000, 100_000])
def test_headers_nested_past_the_parser_are_refused(depth: int) -> None:
    """3,000 levels made every claim fail with RecursionError and roll back (issue 17)."""
    with pytest.raises(ContentError, match=r"nested too deeply|nests deeper"):
        check_headers(nested(depth), max_bytes=10**7)


def test_properties_map_to_amqp_names() -> None:
    got = check_properties(
        {
            "type": "order.created",
            "app_id": "spark",
            "expiration": 60000,
            "priority": 5,
            "timestamp": "2026-11-24T10:00:00+01:00",
            "delivery_mode": 1,
            "correlation_id": None,
        }
    )
    assert got == {
        "delivery_mode": 1,
        "message_type": "order.created",
        "app_id": "spark",
        "expiration": "60000",
        "priority": 5,
        "timestamp": dt.datetime(2026, 11, 24, 9, 0, tzinfo=dt.UTC),
    }


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("exchange", "e" * 256, "exchange is 256 bytes"),
        ("routing_key", "\ud800", "not valid UTF-8"),
        ("message_id", "", "message_id is empty"),
        ("message_id", 42, "message_id must be a string"),
        ("body", "text", "body must be bytes"),
        ("body", b"x" * 1001, "larger than the limit of 1000 bytes"),
        ("content_type", "c" * 300, "content_type is 300 bytes"),
    ],
)
def test_bad_fields_are_refused_with_a_reason(field: str, value: object, reason: str) -> None:
    with pytest.raises(ContentError, match=reason):
        check_row(**row(**{field: value}), limits=LIMITS)


def test_a_decoded_document_is_checked_like_text() -> None:
    assert check_headers({"a": [1, {"b": None}]}) == {"a": [1, {"b": None}]}
    assert load_document(None, what="headers", max_bytes=10) is None


# ------------------------------------------------------------------- fuzz: never a crash

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=140), children, max_size=4)
    ),
    max_leaves=30,
)
stored = st.one_of(
    json_values,
    json_values.map(lambda v: json.dumps(v)),  # NaN/Infinity come through as their tokens
    st.text(max_size=200),
    st.binary(max_size=200),
    st.integers(min_value=1, max_value=5000).map(nested),
)


@settings(max_examples=400, deadline=None)
@given(headers=stored, properties=stored)
def test_any_stored_content_is_checked_or_refused_never_a_crash(
    headers: object, properties: object
) -> None:
    try:
        checked = check_row(**row(headers=headers, properties=properties), limits=LIMITS)
    except ContentError as exc:
        assert str(exc)
    else:
        json.dumps(checked.headers, allow_nan=False)  # a field table can carry it


def test_the_exchange_rule_is_the_codecs() -> None:
    """The pure module keeps its own copy of pamqp's exchange-name rule: the same pattern."""
    from pamqp.constants import DOMAIN_REGEX

    from app.outbox.content import EXCHANGE_NAME

    assert EXCHANGE_NAME.pattern == DOMAIN_REGEX["exchange-name"].pattern


@pytest.mark.parametrize("name", ["no such exchange! (x)", "ex\nchange", "é", "a*b"])
def test_an_exchange_name_no_publish_can_carry_is_refused(name: str) -> None:
    """Issue 48: enqueue accepted ``"no such exchange! (x)"`` and the row ended ``failed`` at
    publish with "Invalid value for exchange"; the publisher's own codec rule now runs first."""
    from pamqp import commands

    with pytest.raises(ValueError, match="Invalid value for exchange"):
        commands.Basic.Publish(exchange=name)  # what the publisher would do with it
    with pytest.raises(ContentError, match="holds characters no publish can carry"):
        check_row(**row(exchange=name), limits=LIMITS)
