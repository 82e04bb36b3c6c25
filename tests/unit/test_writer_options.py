"""The writer's options are one value: ``OutboxOptions``. The sinks take it or its fields as
keywords, and the data source's option keys derive from its fields, so a new option is declared
once and reaches every writer."""

from __future__ import annotations

import pytest

from spark_writer import OutboxConfigError, OutboxOptions, OutboxSink
from spark_writer.options import from_spark_options, options_of

BASE = {"url": "sqlite:////tmp/o.db", "sink": "orders", "exchange": "x", "routing_key": "k"}


def test_keywords_and_the_value_build_the_same_options() -> None:
    value = OutboxOptions(**BASE, ordering_key_column="customer")
    assert options_of(None, {**BASE, "ordering_key_column": "customer"}) == value
    assert options_of(value, {}) is value
    assert OutboxSink(value).options is value
    assert OutboxSink(**BASE).options == OutboxOptions(**BASE)


@pytest.mark.parametrize(
    ("options", "keywords", "message"),
    [
        (None, {**BASE, "routing_keys": "k"}, r"unknown outbox options \['routing_keys'\]"),
        (None, {"sink": "orders"}, "option 'url' is required"),
        (OutboxOptions(**BASE), {"sink": "other"}, "not both"),
        ({"url": "x"}, {}, "must be an OutboxOptions, not dict"),
        (None, {**BASE, "exchange": "orders!"}, "holds characters no publish can carry"),
    ],
)
def test_bad_writer_options_get_a_clear_error(
    options: object, keywords: dict[str, object], message: str
) -> None:
    with pytest.raises(OutboxConfigError, match=message):
        options_of(options, keywords)  # type: ignore[arg-type]


def test_data_source_keys_come_from_the_fields_in_any_case() -> None:
    raw = {
        "url": BASE["url"],
        "SINK": "orders",
        "exchange": "x",
        "routingKey": "k",
        "ordering_key_column": "customer",
        "sequenceColumn": "seq",
        "headerColumns": "a, b",
        "propertyColumns": "priority=p",
        "MAXBODYBYTES": "10",
        "persistent": "false",
    }
    options, batch_id = from_spark_options({**raw, "batchId": "7"})
    assert options == OutboxOptions(
        **BASE,
        ordering_key_column="customer",
        sequence_column="seq",
        header_columns=("a", "b"),
        property_columns={"priority": "p"},
        max_body_bytes=10,
        persistent=False,
    )
    assert batch_id == 7
    with pytest.raises(OutboxConfigError, match="coalesce"):  # a sink option, not a source one
        from_spark_options({**raw, "maxConnections": "2"})
    with pytest.raises(OutboxConfigError, match="unknown outbox option 'routingKeys'"):
        from_spark_options({**raw, "routingKeys": "k"})
