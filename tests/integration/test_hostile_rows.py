"""Rows are untrusted input: whatever anyone with INSERT puts in a row, that row ends ``failed``
with its reason, alone, and every other row drains (real RabbitMQ, PostgreSQL and SQLite).

Before: a row whose headers nested 3,000 deep made every claim fail with RecursionError (0 of 200
good rows published), and a row whose headers were a JSON string crashed the publisher, then the
next publisher after the lease (issue 17).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from app.db import make_engine
from app.outbox.read.messages import message
from tests.support.factories import add_rows
from tests.support.publisher import consume_ids, declare, delete, rows, run_until_empty
from tests.support.publisher import settings_for as publisher_settings

GOOD = 200


def deep(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


#: (name, headers JSON text, properties JSON text, part of the reason)
HOSTILE: list[tuple[str, str | None, str | None, str]] = [
    ("deep", deep(3000), None, "nested too deeply"),
    ("string-headers", '"just text"', None, "headers must be a JSON object, got a string"),
    ("array-headers", "[1, 2, 3]", None, "headers must be a JSON object, got an array"),
    ("array-properties", None, '["priority", 5]', "properties must be a JSON object"),
    ("long-name", json.dumps({"k" * 200: "v"}), None, "over the AMQP limit of 128"),
    ("typo-property", None, '{"prority": 9}', "unknown properties"),
    ("huge-headers", json.dumps({"blob": "x" * 200_000}), None, "over the 65536-byte limit"),
    ("reserved", '{"x-outbox-attempt": 99}', None, "set by the publisher"),
]
#: SQLite stores anything in a JSON column; PostgreSQL's json type refuses these at INSERT.
SQLITE_ONLY: list[tuple[str, str | None, str | None, str]] = [
    ("not-json", "{headers", None, "not valid JSON"),
    ("nan", '{"a": NaN}', None, "not valid JSON"),
]


def insert_raw(engine: Engine, *, message_id: str, exchange: str, **columns: Any) -> None:
    """An INSERT the way a careless producer writes it: JSON columns as raw text."""
    values = {
        "message_id": message_id,
        "batch_id": "hostile:1",
        "exchange": exchange,
        "routing_key": "rk",
        "body": b"{}",
        **columns,
    }
    names = ", ".join(values)
    params = ", ".join(f":{k}" for k in values)
    if engine.dialect.name == "postgresql":
        params = params.replace(":headers", "CAST(:headers AS json)")
        params = params.replace(":properties", "CAST(:properties AS json)")
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO outbox ({names}) VALUES ({params})"), values)


async def test_hostile_rows_fail_alone_and_good_rows_drain(
    engine: Engine, amqp_url: str, db_url: str, topology: dict[str, str]
) -> None:
    exchange = topology["exchange"]
    cases = HOSTILE + (SQLITE_ONLY if engine.dialect.name == "sqlite" else [])
    good = add_rows(engine, n=GOOD // 2, exchange=exchange, prefix="good-a")
    for name, headers, properties, _ in cases:
        insert_raw(
            engine,
            message_id=f"bad-{name}",
            exchange=exchange,
            headers=headers,
            properties=properties,
        )
    good += add_rows(engine, n=GOOD // 2, exchange=exchange, prefix="good-b")

    stats = await run_until_empty(publisher_settings(db_url=db_url, amqp_url=amqp_url), engine)

    by_id = {r.message_id: r for r in rows(engine)}
    assert all(by_id[m].status == "confirmed" for m in good)
    for name, _, _, reason in cases:
        row = by_id[f"bad-{name}"]
        assert (row.status, row.attempts) == ("failed", 1), name
        assert reason in (row.last_error or ""), (name, row.last_error)
    assert stats.failed == len(cases)
    seen = await consume_ids(amqp_url, topology["queue"], expect=GOOD)
    assert set(seen) == set(good) and seen.total() == GOOD
    # the operator can still look at the hostile row (the API read it with the JSON decoder: 500)
    deepest = message(engine, message_id="bad-deep")
    assert deepest is not None and "nested too deeply" in str(deepest.headers)


# --------------------------------------------------- fuzz: any content, good rows drain

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=140), children, max_size=3)
    ),
    max_leaves=20,
)
documents = st.one_of(st.none(), json_values.map(json.dumps), st.integers(40, 400).map(deep))
hostile_rows = st.lists(
    st.fixed_dictionaries(
        {
            "headers": documents,
            "properties": documents,
            "routing_key": st.text(max_size=300).filter(lambda s: "\x00" not in s),
            "content_type": st.none() | st.text(max_size=300).filter(lambda s: "\x00" not in s),
            "body": st.binary(max_size=64),
        }
    ),
    min_size=5,
    max_size=15,
)


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=hostile_rows)
def test_fuzzed_rows_never_stop_the_good_ones(
    batch: list[dict[str, Any]], pg_url: str, amqp_url: str
) -> None:
    """Arbitrary JSON, text and bytes in every column a producer writes; good rows drain."""
    engine = make_engine(pg_url)
    exchange = f"test-fuzz-{uuid.uuid4().hex[:8]}"
    try:
        asyncio.run(declare(amqp_url, exchange=exchange, queue=exchange))
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM outbox"))
        good = add_rows(engine, n=20, exchange=exchange, prefix=uuid.uuid4().hex[:6])
        for i, columns in enumerate(batch):
            insert_raw(
                engine, message_id=f"fuzz-{uuid.uuid4().hex[:6]}-{i}", exchange=exchange, **columns
            )
        settings_ = publisher_settings(db_url=pg_url, amqp_url=amqp_url)
        asyncio.run(asyncio.wait_for(run_until_empty(settings_, engine), 60))
        final = {r.message_id: r for r in rows(engine)}
        assert all(final[m].status == "confirmed" for m in good)
        assert all(r.status in ("confirmed", "failed", "returned") for r in final.values())
        assert all(r.last_error for r in final.values() if r.status == "failed")
    finally:
        asyncio.run(delete(amqp_url, exchanges=(exchange,), queues=(exchange,)))
        engine.dispose()
