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
        (None, {**BASE, "standby_wait": -1.0}, "standby_wait must be seconds, 0 or more"),
        (None, {**BASE, "standby_wait": float("nan")}, "standby_wait must be seconds"),
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
        "standbyWait": "2.5",
    }
    options, batch_id = from_spark_options({**raw, "batchId": "7"})
    assert options == OutboxOptions(
        **BASE,
        ordering_key_column="customer",
        sequence_column="seq",
        header_columns=("a", "b"),
        property_columns={"priority": "p"},
        max_body_bytes=10,
        standby_wait=2.5,
        persistent=False,
    )
    assert batch_id == 7
    with pytest.raises(OutboxConfigError, match="coalesce"):  # a sink option, not a source one
        from_spark_options({**raw, "maxConnections": "2"})
    with pytest.raises(OutboxConfigError, match="unknown outbox option 'routingKeys'"):
        from_spark_options({**raw, "routingKeys": "k"})


@pytest.mark.parametrize(
    ("url", "conninfo"),
    [
        # SQLAlchemy's multi-host form: libpq's host and port lists
        (
            "postgresql+psycopg://u:p%40ss@/outbox?host=a:5432&host=b:6432"
            "&target_session_attrs=read-write",
            "target_session_attrs=read-write host=a,b port=5432,6432 user=u password=p@ss "
            "dbname=outbox",
        ),
        # a host without a port takes the default
        (
            "postgresql://u@/db?host=a&host=b:6432",
            "host=a,b port=5432,6432 user=u dbname=db",
        ),
        # one host, and a Unix socket directory: as libpq reads the URI
        ("postgresql+psycopg://u:p@h:5/db", "postgresql://u:p@h:5/db"),
        (
            "postgresql://u@/db?host=/var/run/postgresql",
            "postgresql://u@/db?host=/var/run/postgresql",
        ),
    ],
)
def test_the_writer_reads_database_urls_as_the_product_does(url: str, conninfo: str) -> None:
    """Issue 49: the executors passed a multi-host URL to libpq as a URI: libpq kept the last
    ``host=`` and took ``b:6432`` for a host name, so a Spark job could not follow a failover."""
    from spark_writer.dburl import pg_conninfo

    assert pg_conninfo(url) == conninfo
