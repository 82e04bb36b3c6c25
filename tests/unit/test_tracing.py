"""W3C trace context checks (pure), and OpenTelemetry loaded only when a traced message is
handled or a message is enqueued: importing the enqueue API, the publisher or the consumer kit
imports neither OpenTelemetry nor (for the API) the publisher and its broker client."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.tracing import TraceContextError, checked_headers, trace_id_of
from tests.support.env import REPO

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_w3c_traceparent_and_tracestate_pass() -> None:
    assert checked_headers(GOOD) == {"traceparent": GOOD}
    assert checked_headers(GOOD, "congo=t61rcWkgMzE") == {
        "traceparent": GOOD,
        "tracestate": "congo=t61rcWkgMzE",
    }
    assert checked_headers(GOOD, "") == {"traceparent": GOOD}
    assert trace_id_of(GOOD) == "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    ("traceparent", "tracestate", "reason"),
    [
        (GOOD.upper(), None, "is not W3C trace context"),
        (GOOD[:-1], None, "is not W3C trace context"),
        (GOOD + "\n", None, "is not W3C trace context"),
        ("ff" + GOOD[2:], None, "invalid version"),
        ("00-" + "0" * 32 + GOOD[35:], None, "zero id"),
        (GOOD[:36] + "0" * 16 + "-01", None, "zero id"),
        (b"00-", None, "must be a string, got bytes"),
        (GOOD, "x" * 513, "at most 512"),
        (GOOD, "k=\n", "printable ASCII"),
        (GOOD, 7, "tracestate must be a string"),
    ],
)
def test_a_malformed_trace_context_is_refused(
    traceparent: object, tracestate: object, reason: str
) -> None:
    with pytest.raises(TraceContextError, match=reason):
        checked_headers(traceparent, tracestate)


def test_importing_the_api_the_publisher_or_the_consumer_loads_no_opentelemetry() -> None:
    code = (
        "import sys\n"
        "import app.outbox.enqueue\n"
        "assert not [m for m in sys.modules if m.startswith(('app.publisher', 'aio_pika',"
        " 'pamqp'))], 'the API imports the publisher'\n"
        "import app.publisher, app.publisher.engine, app.consumer.kit\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_trace_context_checks_are_pure() -> None:
    """app.tracing is importable alone: no SQLAlchemy, no driver, no asyncio, no OpenTelemetry
    until a function needs it."""
    code = (
        "import sys\n"
        "import app.tracing\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in"
        " ('sqlalchemy', 'psycopg', 'asyncio', 'opentelemetry', 'pamqp')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_enqueue_never_changes_the_callers_header_dicts() -> None:
    """Rows reuse the caller's dicts when nothing is added (no copy per message); a trace
    context is added to a new dict, so a dict shared by many messages stays as it was."""
    from app.outbox.enqueue import Message, prepare

    shared = {"tenant": "t-1"}
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    plain = Message(exchange="x", routing_key="k", body=b"1", message_id="a", headers=shared)
    traced = Message(
        exchange="x", routing_key="k", body=b"2", message_id="b", headers=shared, traceparent=parent
    )
    rows = prepare([plain, traced])
    assert shared == {"tenant": "t-1"}
    assert rows[0]["headers"] == {"tenant": "t-1"}
    assert rows[1]["headers"] == {"tenant": "t-1", "traceparent": parent}
