"""One trace from the application's enqueue to the consumer's handler: the ``traceparent`` of
the span current at enqueue is written into the row, published as an AMQP header by the real
publisher, and the consumer kit runs the handler in a span of the same trace (OpenTelemetry's
SDK with its in-memory exporter)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from app.consumer import ConsumerConfig
from app.consumer.inbox import Message as Delivered
from app.db import make_engine
from app.outbox.enqueue import Message, enqueue
from app.outbox.records import ClaimedRow
from app.outbox.schema import outbox
from app.publisher.outcomes import Outcomes
from app.publisher.spans import BatchSpans
from tests.support.consumer import declared_queue, running_consumer, until
from tests.support.publisher import run_until_empty, settings_for

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (set once: OpenTelemetry refuses to replace it)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


async def test_one_trace_from_enqueue_to_the_consumers_handler(
    pg_url: str, amqp_url: str, spans: InMemorySpanExporter
) -> None:
    engine = make_engine(pg_url)
    seen: list[tuple[str, str]] = []

    def handler(message: Delivered, _conn: Connection) -> None:
        current = trace.get_current_span().get_span_context()
        seen.append((message.message_id, f"{current.trace_id:032x}"))

    tracer = trace.get_tracer("test.orders")
    try:
        async with declared_queue(amqp_url, prefix="test-tracing") as queue:
            with (
                tracer.start_as_current_span("POST /orders") as request,
                Session(engine) as session,
                session.begin(),
            ):
                enqueue(
                    session,
                    [
                        Message(exchange="", routing_key=queue, body=b"{}", message_id="traced"),
                        Message(
                            exchange="",
                            routing_key=queue,
                            body=b"{}",
                            message_id="given",
                            traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
                            tracestate="vendor=x",
                        ),
                        Message(
                            exchange="",
                            routing_key=queue,
                            body=b"{}",
                            message_id="header",
                            headers={"traceparent": "00-" + "4" * 32 + "-" + "5" * 16 + "-01"},
                        ),
                    ],
                )
            trace_id, span_id = hex_ids(request)  # type: ignore[arg-type]
            with engine.connect() as conn:
                headers = dict(conn.execute(select(outbox.c.message_id, outbox.c.headers)).all())
            assert list(headers["traced"]) == ["traceparent"]  # flags: the SDK's (01 or 03)
            assert headers["traced"]["traceparent"].startswith(f"00-{trace_id}-{span_id}-")
            assert headers["given"]["tracestate"] == "vendor=x"
            assert headers["header"] == {"traceparent": "00-" + "4" * 32 + "-" + "5" * 16 + "-01"}
            await run_until_empty(settings_for(db_url=pg_url, amqp_url=amqp_url), engine)
            config = ConsumerConfig(name="traced", queue=queue)
            async with running_consumer(amqp_url, engine, config, handler=handler):
                await until(lambda: len(seen) == 3, timeout=30, what="every delivery handled")
    finally:
        engine.dispose()
    assert dict(seen) == {"traced": trace_id, "given": "1" * 32, "header": "4" * 32}
    finished = {s.name: s for s in spans.get_finished_spans()}
    consumed = [s for s in spans.get_finished_spans() if s.kind == trace.SpanKind.CONSUMER]
    assert len(consumed) == 3 and "POST /orders" in finished
    mine = next(s for s in consumed if s.attributes["messaging.message.id"] == "traced")
    assert mine.parent is not None and f"{mine.parent.span_id:016x}" == span_id
    assert hex_ids(mine)[0] == trace_id


async def test_a_batch_handler_runs_in_a_span_linked_to_each_messages_trace(
    pg_url: str, amqp_url: str, spans: InMemorySpanExporter
) -> None:
    engine = make_engine(pg_url)
    traces = {"b-1": "1" * 32, "b-2": "2" * 32}
    handled: list[str] = []

    def batch_handler(messages: Sequence[Delivered], _conn: Connection) -> None:
        assert trace.get_current_span().is_recording()
        handled.extend(m.message_id for m in messages)

    try:
        async with declared_queue(amqp_url, prefix="test-tracing") as queue:
            with Session(engine) as session, session.begin():
                enqueue(
                    session,
                    [
                        Message(
                            exchange="",
                            routing_key=queue,
                            body=b"{}",
                            message_id=mid,
                            traceparent=f"00-{tid}-{'3' * 16}-01",
                        )
                        for mid, tid in traces.items()
                    ],
                )
            await run_until_empty(settings_for(db_url=pg_url, amqp_url=amqp_url), engine)
            config = ConsumerConfig(name="batched", queue=queue)
            async with running_consumer(amqp_url, engine, config, batch_handler=batch_handler):
                await until(lambda: len(handled) == 2, timeout=30, what="both handled")
    finally:
        engine.dispose()
    batches = [s for s in spans.get_finished_spans() if s.name == "outbox batch process"]
    linked = {f"{link.context.trace_id:032x}" for s in batches for link in s.links}
    assert batches and linked == set(traces.values())


async def test_publisher_tracing_records_a_span_per_batch_linked_to_each_rows_trace(
    pg_url: str, amqp_url: str, spans: InMemorySpanExporter
) -> None:
    """``OUTBOX_PUBLISHER_TRACING``: each published batch is one PRODUCER span, linked to the
    trace of each of its rows that has one, counting how its rows ended; a batch with a row the
    broker returned ends in ERROR. Off, the same drain records no publisher span."""
    engine = make_engine(pg_url)
    traced = {f"t-{i}": f"{i + 1:032x}" for i in range(5)}
    try:
        async with declared_queue(amqp_url, prefix="test-tracing") as queue:
            with Session(engine) as session, session.begin():
                enqueue(
                    session,
                    [
                        Message(
                            exchange="",
                            routing_key=queue,
                            body=b"{}",
                            message_id=mid,
                            traceparent=f"00-{tid}-{'3' * 16}-01",
                        )
                        for mid, tid in traced.items()
                    ]
                    + [
                        Message(exchange="", routing_key=queue, body=b"{}", message_id=f"u-{i}")
                        for i in range(3)
                    ]
                    + [Message(exchange="", routing_key="no-such-queue", body=b"{}")],
                )
            settings = settings_for(db_url=pg_url, amqp_url=amqp_url, publisher_tracing=True)
            await run_until_empty(settings, engine)
            produced = [s for s in spans.get_finished_spans() if s.name == "outbox publish"]
            assert produced and all(s.kind == trace.SpanKind.PRODUCER for s in produced)
            attrs = [dict(s.attributes or {}) for s in produced]
            assert sum(int(a["messaging.batch.message_count"]) for a in attrs) == 9
            assert sum(int(a.get("outbox.confirmed", 0)) for a in attrs) == 8
            assert sum(int(a.get("outbox.returned", 0)) for a in attrs) == 1
            linked = {f"{link.context.trace_id:032x}" for s in produced for link in s.links}
            assert linked == set(traced.values())
            errors = [s for s in produced if not s.status.is_ok]
            assert len(errors) == 1 and errors[0].status.description == "1 rows not delivered"
            assert all(s.end_time is not None and s.end_time >= s.start_time for s in produced)

            spans.clear()
            with Session(engine) as session, session.begin():
                enqueue(session, [Message(exchange="", routing_key=queue, body=b"{}")])
            await run_until_empty(settings_for(db_url=pg_url, amqp_url=amqp_url), engine)
            assert not [s for s in spans.get_finished_spans() if s.name == "outbox publish"]
    finally:
        engine.dispose()


def test_a_publisher_that_stops_ends_its_open_batch_spans_saying_what_it_left(
    spans: InMemorySpanExporter,
) -> None:
    batch = BatchSpans(publisher_id="p1")
    rows = [
        ClaimedRow(i, f"m-{i}", "b", "ex", "rk", True, b"{}", None, None, None, None, 1, 10)
        for i in range(1, 4)
    ]
    batch.published(rows)
    out = Outcomes()
    out.confirmed.append(1)
    batch.settled(out)
    assert batch.open == 1 and not spans.get_finished_spans()
    batch.close()
    (span,) = spans.get_finished_spans()
    assert span.attributes is not None
    assert (span.attributes["outbox.confirmed"], span.attributes["outbox.unsettled"]) == (1, 2)
    assert span.attributes["messaging.destination.name"] == "ex" and batch.open == 0
