"""The application API (``app.outbox.enqueue``): messages written on the caller's session,
connection or psycopg connection, inside the caller's transaction, by the rules of
``app.outbox.content``. Both backends where the API exists on both (SQLAlchemy); psycopg and the
async session on PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, func, make_url, select, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from app.outbox import enqueue as api
from app.outbox.enqueue import (
    InvalidMessage,
    Message,
    MessageConflict,
    enqueue,
    enqueue_async,
    enqueue_psycopg,
)
from app.outbox.schema import outbox
from app.tracing import checked_headers
from tests.support.publisher import all_in, consume_ids, running_publisher, settings_for, wait_rows

LATER = dt.timedelta(hours=1)


def msg(n: int | str, **kw: Any) -> Message:
    base: dict[str, Any] = {
        "exchange": "orders",
        "routing_key": "order.created",
        "body": f'{{"n": "{n}"}}'.encode(),
        "message_id": f"m-{n}",
    }
    return Message(**{**base, **kw})


def stored(engine: Engine) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        found = conn.execute(select(outbox).order_by(outbox.c.id)).mappings().all()
    return {r["message_id"]: dict(r) for r in found}


def test_messages_commit_and_roll_back_with_the_callers_transaction(engine: Engine) -> None:
    with Session(engine) as session:
        with session.begin():
            got = enqueue(
                session, [msg(1), msg(2, headers={"tenant": "t1"}, properties={"type": "order"})]
            )
            assert got.inserted == ("m-1", "m-2") and got.duplicates == ()
            assert stored(engine) == {}  # not committed: invisible to others
        with session.begin():
            enqueue(session, [msg(3)])
            session.rollback()
    rows = stored(engine)
    assert list(rows) == ["m-1", "m-2"]
    assert rows["m-2"]["headers"] == {"tenant": "t1"}
    assert rows["m-2"]["properties"] == {"type": "order"}
    assert rows["m-1"]["batch_id"] == "app" and rows["m-1"]["status"] == "pending"
    assert rows["m-1"]["body"] == b'{"n": "1"}' and rows["m-1"]["not_before"] is None


def test_on_a_core_connection_the_caller_commits(engine: Engine) -> None:
    with engine.connect() as conn:
        enqueue(conn, [msg(1)], source="orders-service")
        assert conn.in_transaction()  # begun as for any statement, and left to the caller
        conn.rollback()
        enqueue(conn, [msg(2)], source="orders-service")
        conn.commit()
    assert [(k, v["batch_id"]) for k, v in stored(engine).items()] == [("m-2", "orders-service")]


def test_re_enqueueing_a_message_is_a_duplicate_not_a_second_row(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        enqueue(session, [msg(1), msg(2)])
    with Session(engine) as session, session.begin():
        # a retried request: same messages, another trace, a delay computed again
        got = enqueue(
            session,
            [
                msg(1, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
                msg(2, not_before=dt.datetime.now(dt.UTC) + LATER),
                msg(3),
                msg(3),
            ],
        )
    assert got.inserted == ("m-3",) and got.duplicates == ("m-1", "m-2")
    assert list(stored(engine)) == ["m-1", "m-2", "m-3"]


def test_the_same_id_with_other_content_is_refused_and_the_call_leaves_nothing(
    engine: Engine,
) -> None:
    with Session(engine) as session, session.begin():
        enqueue(session, [msg(1)])
    with Session(engine) as session, session.begin():
        enqueue(session, [msg(2)])  # an earlier call of the same transaction
        with pytest.raises(
            MessageConflict, match="'m-1' is already in the outbox with another routing_key, body"
        ) as caught:
            enqueue(session, [msg(3), msg(1, routing_key="order.paid", body=b"other")])
        assert caught.value.message_id == "m-1"
    assert list(stored(engine)) == ["m-1", "m-2"]  # m-3 of the refused call was taken back
    with (
        pytest.raises(MessageConflict, match=r"'m-4'.*another body"),
        Session(engine) as session,
        session.begin(),
    ):
        enqueue(session, [msg(4), msg(4, body=b"else")])  # twice in one call


BAD_INPUT: list[tuple[str, dict[str, Any], str]] = [
    ("body as text", {"body": "not bytes"}, "body must be bytes, got str"),
    ("body too large", {"body": b"x" * 2049}, "body is 2049 bytes, larger than the limit"),
    ("exchange too long", {"exchange": "e" * 256}, "exchange is 256 bytes, over the AMQP limit"),
    ("routing key not text", {"routing_key": 42}, "routing key must be a string, got int"),
    ("empty message id", {"message_id": ""}, "message_id is empty"),
    ("NUL in message id", {"message_id": "a\x00b"}, "message_id contains a NUL"),
    (
        "reserved header",
        {"headers": {"x-outbox-id": 1}},
        "header 'x-outbox-id' is set by the publisher",
    ),
    ("header not finite", {"headers": {"n": float("nan")}}, "headers.n is not a finite number"),
    (
        "header of a bad type",
        {"headers": {"when": dt.date(2026, 1, 1)}},
        "headers.when has a value of type date",
    ),
    (
        "headers nested too deep",
        {"headers": {"a": {"a": {"a": {"a": {"a": {"a": {"a": {"a": {"a": 1}}}}}}}}}},
        "nests deeper than 8 levels",
    ),
    ("headers not a mapping", {"headers": [("a", 1)]}, "headers must be a mapping, got list"),
    (
        "properties as JSON text",
        {"properties": '{"type": "x"}'},
        "properties must be a mapping, got str",
    ),
    ("unknown property", {"properties": {"colour": "red"}}, "unknown properties ['colour']"),
    ("bad priority", {"properties": {"priority": 300}}, "property priority must be one of 0..255"),
    ("bad expiration", {"properties": {"expiration": "soon"}}, "expiration must be milliseconds"),
    ("ordering key too long", {"ordering_key": "k" * 300}, "ordering key is 300 bytes"),
    (
        "naive not_before",
        {"not_before": dt.datetime(2030, 1, 1)},
        "not_before must be timezone-aware",
    ),
    ("not_before not a time", {"not_before": "tomorrow"}, "not_before must be a datetime"),
    (
        "not_before parked",
        {"not_before": dt.datetime(9999, 6, 1, tzinfo=dt.UTC)},
        "later than the year 9998",
    ),
    ("traceparent not a string", {"traceparent": 7}, "traceparent must be a string, got int"),
    (
        "an exchange the publisher cannot encode",
        {"exchange": "no such exchange! (x)"},
        "holds characters no publish can carry",
    ),
    ("mandatory not a bool", {"mandatory": "yes"}, "mandatory must be a boolean"),
]


@pytest.mark.parametrize(("_case", "bad", "reason"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_untrusted_input_gets_a_clear_error_and_loses_nothing_else(
    engine: Engine, _case: str, bad: dict[str, Any], reason: str
) -> None:
    """A call with one bad message writes none of its messages; the messages of the valid call
    before it, in the same transaction, commit and are intact."""
    limits = api.Limits(max_body_bytes=2048)
    with Session(engine) as session, session.begin():
        enqueue(session, [msg(1), msg(2)], limits=limits)
        with pytest.raises(InvalidMessage, match=r"^message 1 ") as caught:
            enqueue(session, [msg(3), msg(4, **bad), msg(5)], limits=limits)
        assert reason in caught.value.reason
    assert list(stored(engine)) == ["m-1", "m-2"]


def test_something_that_is_not_a_message_is_refused(engine: Engine) -> None:
    with (
        Session(engine) as session,
        session.begin(),
        pytest.raises(InvalidMessage, match="message 0: expected an outbox Message, got dict"),
    ):
        enqueue(session, [{"exchange": "orders"}])  # type: ignore[list-item]


def test_many_messages_in_one_call(engine: Engine) -> None:
    """More than one page of the multi-row INSERT (1,000 rows each), duplicates spread over it."""
    with Session(engine) as session, session.begin():
        enqueue(session, [msg(n) for n in range(0, 2500, 7)])
    with Session(engine) as session, session.begin():
        got = enqueue(session, [msg(n) for n in range(2500)])
    assert len(got.inserted) == 2500 - len(range(0, 2500, 7))
    assert got.duplicates == tuple(f"m-{n}" for n in range(0, 2500, 7))
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(outbox)).scalar_one() == 2500


def test_a_delayed_message_is_due_at_its_time(engine: Engine) -> None:
    at = dt.datetime.now(dt.UTC) + LATER
    with Session(engine) as session, session.begin():
        enqueue(session, [msg(1, not_before=at), msg(2, not_before=at - 2 * LATER), msg(3)])
    rows = stored(engine)
    assert rows["m-1"]["not_before"] == at and rows["m-1"]["available_at"] == at
    # a time already past is due now (the database's clock), not earlier than other rows
    assert rows["m-2"]["available_at"] >= rows["m-3"]["created_at"] - dt.timedelta(seconds=1)
    assert rows["m-2"]["available_at"] < at


def test_metrics_count_what_the_calls_did(engine: Engine) -> None:
    before = api.METRICS.inserted, api.METRICS.duplicates, api.METRICS.invalid
    with Session(engine) as session, session.begin():
        enqueue(session, [msg(1), msg(2, not_before=dt.datetime.now(dt.UTC) + LATER)])
        enqueue(session, [msg(1)])
        with pytest.raises(InvalidMessage):
            enqueue(session, [msg(3, body=None)])
    after = api.METRICS.inserted, api.METRICS.duplicates, api.METRICS.invalid
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 1, 1]
    families = {f.name: f for f in api.enqueue_collector().collect()}
    samples = {s.labels["outcome"]: s.value for s in families["outbox_enqueue_messages"].samples}
    assert samples["inserted"] == api.METRICS.inserted and samples["delayed"] >= 1


# ------------------------------------------------------------------ PostgreSQL drivers


def _async_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
async def test_on_an_async_session(engine: Engine, db_url: str) -> None:
    async_engine = create_async_engine(_async_url(db_url))
    try:
        async with AsyncSession(async_engine) as session:
            async with session.begin():
                got = await enqueue_async(session, [msg(1), msg(2)])
            assert got.inserted == ("m-1", "m-2")
            async with session.begin():
                await enqueue_async(session, [msg(3)])
                await session.rollback()
            async with session.begin():
                with pytest.raises(MessageConflict):
                    await enqueue_async(session, [msg(4), msg(1, body=b"other")])
        async with async_engine.connect() as conn:
            await enqueue_async(conn, [msg(5)])
            await conn.commit()
    finally:
        await async_engine.dispose()
    assert list(stored(engine)) == ["m-1", "m-2", "m-5"]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_on_a_plain_psycopg_connection(engine: Engine, db_url: str) -> None:
    at = dt.datetime.now(dt.UTC) + LATER
    with psycopg.connect(_libpq(db_url)) as conn:
        got = enqueue_psycopg(conn, [msg(1, headers={"a": [1, 2]}, not_before=at), msg(2)])
        assert got.inserted == ("m-1", "m-2")
        conn.rollback()
        enqueue_psycopg(conn, [msg(1, headers={"a": [1, 2]}, not_before=at), msg(2)])
        assert enqueue_psycopg(conn, [msg(2), msg(3)]).duplicates == ("m-2",)
        with pytest.raises(MessageConflict):
            enqueue_psycopg(conn, [msg(4), msg(1, headers={"a": [2]})])
        with pytest.raises(InvalidMessage, match=r"message 0 .*body must be bytes"):
            enqueue_psycopg(conn, [msg(5, body="text")])
        conn.commit()
    with (
        psycopg.connect(_libpq(db_url), autocommit=True) as conn,
        pytest.raises(api.EnqueueError, match="not autocommit"),
    ):
        enqueue_psycopg(conn, [msg(6)])
    rows = stored(engine)
    assert list(rows) == ["m-1", "m-2", "m-3"]
    assert rows["m-1"]["headers"] == {"a": [1, 2]} and rows["m-1"]["available_at"] == at


# ------------------------------------------------------------ the publisher wakes up

SLOW_POLL = 5.0  # a poll this slow cannot explain a publish within a second


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
async def test_a_commit_wakes_the_publisher_and_the_message_reaches_the_broker(
    engine: Engine, db_url: str, amqp_url: str, topology: dict[str, str]
) -> None:
    """The insert's trigger notifies at commit: no poll needed (SLOW_POLL would take 5 s)."""
    settings = settings_for(db_url=db_url, amqp_url=amqp_url, poll_interval=SLOW_POLL)
    async with running_publisher(settings, engine) as publisher:
        deadline = time.monotonic() + 10
        while not publisher.listener.listening and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(SLOW_POLL + 0.5)  # the startup claims are over: the claimer idles
        began = time.monotonic()
        with Session(engine) as session, session.begin():
            enqueue(
                session, [msg(n, exchange=topology["exchange"], routing_key="rk") for n in range(3)]
            )
        await wait_rows(engine, all_in("confirmed"), timeout=30)
        took = time.monotonic() - began
    assert took < 1.0, f"{took:.2f}s: the commit did not wake the publisher"
    seen = await consume_ids(amqp_url, topology["queue"], expect=3, idle=0.3)
    assert seen == {"m-0": 1, "m-1": 1, "m-2": 1}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_id_committed_by_another_transaction_meanwhile_is_a_race_to_roll_back(
    engine: Engine,
) -> None:
    """T1 holds m-1 uncommitted; T2's lookup cannot see it, its insert waits on T1's row and,
    once T1 commits, violates the unique index: T2 learns it raced and rolls back."""
    first = Session(engine)
    first.begin()
    enqueue(first, [msg(1)])
    raced: list[BaseException] = []

    def second() -> None:
        with Session(engine) as session:
            session.begin()
            try:
                enqueue(session, [msg(2), msg(1)])
            except api.EnqueueRaced as exc:
                raced.append(exc)
                session.rollback()
            else:
                session.commit()

    worker = threading.Thread(target=second)
    worker.start()
    time.sleep(0.5)  # the second insert now waits on m-1's row lock
    first.commit()
    first.close()
    worker.join(10)
    assert len(raced) == 1 and "one of these 2 message ids" in str(raced[0])
    assert list(stored(engine)) == ["m-1"]  # the second transaction rolled back


def test_one_message_per_call_is_one_statement_and_still_idempotent(engine: Engine) -> None:
    """Issue 48, Low 10: a web request's one message cost a lookup round trip before its
    INSERT (2.09-2.24 x a plain INSERT). One message is now ``INSERT … ON CONFLICT DO NOTHING
    RETURNING``: one statement when the id is new; the stored row is read only when it is not."""
    statements: list[str] = []

    def count(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        with Session(engine) as session, session.begin():
            statements.clear()
            assert enqueue(session, [msg(1)]).inserted == ("m-1",)
            assert len(statements) == 1 and "ON CONFLICT" in statements[0]
        with Session(engine) as session, session.begin():
            got = enqueue(session, [msg(1, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")])
            assert got.duplicates == ("m-1",) and got.inserted == ()
            with pytest.raises(MessageConflict, match="'m-1' is already in the outbox"):
                enqueue(session, [msg(1, body=b"other")])
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert list(stored(engine)) == ["m-1"]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("ends", ["commit", "rollback"])
def test_one_message_racing_an_uncommitted_one_waits_and_settles_by_its_outcome(
    engine: Engine, ends: str
) -> None:
    """T1 holds m-1 uncommitted; T2's single insert waits on it. T1 commits: T2's message is a
    duplicate (same content), no race to retry. T1 rolls back: T2 inserts it."""
    first = Session(engine)
    first.begin()
    enqueue(first, [msg(1)])
    got: list[Any] = []

    def second() -> None:
        with Session(engine) as session, session.begin():
            got.append(enqueue(session, [msg(1)]))

    worker = threading.Thread(target=second)
    worker.start()
    time.sleep(0.5)  # the second insert now waits on m-1's row
    getattr(first, ends)()
    first.close()
    worker.join(10)
    [outcome] = got
    if ends == "commit":
        assert outcome.duplicates == ("m-1",) and outcome.inserted == ()
    else:
        assert outcome.inserted == ("m-1",)
    assert list(stored(engine)) == ["m-1"]


def test_a_hand_written_row_with_odd_json_is_a_conflict_not_a_crash(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body,"
                " headers) VALUES ('m-1', 'by-hand', 'orders', 'order.created',"
                " :body, '[1, 2]')"
            ),
            {"body": b'{"n": "1"}'},
        )
    with (
        Session(engine) as session,
        session.begin(),
        pytest.raises(MessageConflict, match="another headers"),
    ):
        enqueue(session, [msg(1)])


GOOD_PARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


@pytest.mark.parametrize(
    "trace",
    [
        {"traceparent": "00-abc-def-01"},
        {"traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "tracestate": "k=v"},
        {"tracestate": "k=v"},
        {"traceparent": GOOD_PARENT, "tracestate": "bad\nstate"},
        {"headers": {"traceparent": "junk", "tracestate": "k=v", "kept": 1}},
    ],
)
def test_a_malformed_incoming_trace_context_starts_a_new_trace(
    engine: Engine, trace: dict[str, Any]
) -> None:
    """Issue 48: the docs pass the incoming request's ``traceparent``; a client's malformed
    header made enqueue raise, a 500 for the whole request. W3C Trace Context: an invalid parent
    is ignored and a new trace starts. The message is stored, without the bad context (a
    message's own malformed ``traceparent`` header is no longer sent on unchecked either), and
    the ignored context is counted."""
    before = api.METRICS.trace_ignored
    with Session(engine) as session, session.begin():
        got = enqueue(session, [msg(1, **trace), msg(2, traceparent=GOOD_PARENT)])
    assert len(got.inserted) == 2
    rows = stored(engine)
    headers = rows["m-1"]["headers"] or {}
    # a new trace: the current span's context when a tracer is active in this process (another
    # test may have set one up), never the malformed one
    bad = {trace.get("traceparent"), (trace.get("headers") or {}).get("traceparent")}
    assert headers.get("traceparent") not in bad - {None}
    if "traceparent" in headers:
        checked_headers(headers["traceparent"], headers.get("tracestate"))
    else:
        assert "tracestate" not in headers
    if "headers" in trace:
        assert headers.get("kept") == 1
    assert (rows["m-2"]["headers"] or {})["traceparent"] == GOOD_PARENT
    assert api.METRICS.trace_ignored == before + 1


def test_a_broker_header_cannot_be_enqueued(engine: Engine) -> None:
    """Issue 48: enqueue accepted ``x-delivery-count``, the header consumers read as the
    broker's count of redeliveries."""
    with (
        Session(engine) as session,
        session.begin(),
        pytest.raises(InvalidMessage, match="'x-delivery-count' is set by the broker"),
    ):
        enqueue(session, [msg(1, headers={"x-delivery-count": 999})])
    assert stored(engine) == {}
