"""The Spark writer refuses what the publisher would refuse (app.outbox.content): header names
over 128 bytes or reserved, header values that cannot fit the publisher's header limit. So a row
the writer accepts never fails at publish for its headers."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from spark_writer import OutboxConfigError, OutboxDataError, OutboxSink, write_outbox
from spark_writer.rules import header_value_limit
from tests.support import dbview

pytestmark = pytest.mark.spark


def test_header_names_the_publisher_refuses_are_a_config_error() -> None:
    long_name = "h" * 129
    with pytest.raises(OutboxConfigError, match="longer than 128 bytes"):
        OutboxSink(
            url="sqlite:///x.db",
            sink="s",
            exchange="e",
            routing_key="r",
            header_columns=[long_name],
        )
    with pytest.raises(OutboxConfigError, match="the publisher sets itself"):
        OutboxSink(
            url="sqlite:///x.db",
            sink="s",
            exchange="e",
            routing_key="r",
            header_columns=["x-outbox-id"],
        )


@pytest.mark.spark_api
def test_a_header_value_over_its_share_fails_the_batch_or_is_rejected_alone(
    spark: SparkSession, db_url: str
) -> None:
    limit = header_value_limit(2)
    rows = [(i, f"t{i}", "n" if i != 3 else "x" * (limit + 1)) for i in range(6)]
    df = spark.createDataFrame(rows, "id long, tenant string, note string")
    common = {
        "url": db_url,
        "exchange": "e",
        "routing_key": "r",
        "header_columns": ["tenant", "note"],
        "message_id_column": "id",
    }
    with pytest.raises(OutboxDataError, match=f"column 'note' \\(header\\) is longer than {limit}"):
        write_outbox(df, sink="fail", batch_id=1, **common)  # type: ignore[arg-type]
    assert dbview.count(db_url, "outbox") == 0
    result = write_outbox(df, sink="rej", batch_id=1, on_invalid="reject", **common)  # type: ignore[arg-type]
    assert (result.written, result.rejected) == (5, 1)
    (reject,) = dbview.rejects(db_url)
    assert reject["message_id"] == "3" and f"over the {limit}-byte limit" in reject["reason"]
