"""W3C Trace Context for outbox messages, with OpenTelemetry as an optional extra.

A message carries its trace as the AMQP headers ``traceparent`` and ``tracestate``
(https://www.w3.org/TR/trace-context/): written into the row's ``headers`` by the writer (the
application API takes them as arguments or from the current OpenTelemetry context; a Spark job
writes them as header values), published as they are, and read by the consumer kit, which runs
the handler inside a span that continues that trace.

OpenTelemetry (``pip install 'outbox-sink[otel]'``) is imported only by the functions that need
it, the first time they run, and only if it is installed: without it :func:`current_context`
returns ``None`` and :func:`consumer_span` is a no-op context manager. The format checks here are
pure and stdlib-only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: The spec's limit for ``tracestate`` (32 list members of at most 256 characters, but
#: implementations may cut at 512 characters).
TRACESTATE_MAX = 512
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACESTATE = re.compile(r"[\x20-\x7e]*")


class TraceContextError(ValueError):
    """A trace context that is not W3C Trace Context. Callers ignore it and start a new trace
    (W3C: an invalid parent is ignored), never fail on it."""


#: ``{"traceparent": ..., "tracestate": ...}`` (tracestate only when there is one)
TraceContext = dict[str, str]


def checked_headers(traceparent: object, tracestate: object = None) -> TraceContext:
    """A trace context given by a caller, checked; raises :class:`TraceContextError`."""
    if not isinstance(traceparent, str):
        raise TraceContextError(f"traceparent must be a string, got {type(traceparent).__name__}")
    match = _TRACEPARENT.fullmatch(traceparent)
    if match is None:
        raise TraceContextError(
            f"traceparent {traceparent[:80]!r} is not W3C trace context "
            "(version-traceid-parentid-flags in lower-case hex, 00-<32>-<16>-<2>)"
        )
    version, trace_id, parent_id, _flags = match.groups()
    if version == "ff" or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        raise TraceContextError(f"traceparent {traceparent!r} has an invalid version or a zero id")
    out = {TRACEPARENT: traceparent}
    if tracestate is not None:
        if not isinstance(tracestate, str):
            raise TraceContextError(f"tracestate must be a string, got {type(tracestate).__name__}")
        if len(tracestate) > TRACESTATE_MAX or not _TRACESTATE.fullmatch(tracestate):
            raise TraceContextError(
                f"tracestate must be printable ASCII of at most {TRACESTATE_MAX} characters"
            )
        if tracestate:
            out[TRACESTATE] = tracestate
    return out


def trace_id_of(traceparent: str) -> str | None:
    """The 32-hex trace id of a well-formed ``traceparent``, else None."""
    match = _TRACEPARENT.fullmatch(traceparent)
    return match.group(2) if match else None


@functools.cache
def _otel() -> Any:
    """The OpenTelemetry API modules (``propagate``, ``trace``), or None when not installed."""
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return None
    return propagate, trace


def current_context() -> TraceContext | None:
    """The current OpenTelemetry span's trace context as headers, or None (no OpenTelemetry, or
    no span recording)."""
    otel = _otel()
    if otel is None:
        return None
    propagate, _trace = otel
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if TRACEPARENT not in carrier:
        return None
    try:
        return checked_headers(carrier[TRACEPARENT], carrier.get(TRACESTATE))
    except TraceContextError:
        return None


@contextlib.contextmanager
def consumer_span(
    headers: Mapping[str, Any], *, name: str, attributes: Mapping[str, Any]
) -> Iterator[None]:
    """Run the body inside a CONSUMER span continuing the trace of ``headers``; a no-op without
    OpenTelemetry or without a (valid) ``traceparent``."""
    otel = _otel()
    parent = _text(headers.get(TRACEPARENT)) if otel is not None else None
    if otel is None or parent is None:
        yield
        return
    propagate, trace = otel
    carrier = {TRACEPARENT: parent}
    state = _text(headers.get(TRACESTATE))
    if state is not None:
        carrier[TRACESTATE] = state
    ctx = propagate.extract(carrier)
    trace, tracer = _tracer(otel, "consumer")
    with tracer.start_as_current_span(
        name, context=ctx, kind=trace.SpanKind.CONSUMER, attributes=dict(attributes)
    ):
        yield


@contextlib.contextmanager
def linked_span(
    many: Sequence[Mapping[str, Any]], *, name: str, attributes: Mapping[str, Any]
) -> Iterator[None]:
    """Run the body inside one CONSUMER span linked to the trace of each of ``many`` headers
    that carries a ``traceparent`` (a batch has many parents: OpenTelemetry's answer is links);
    a no-op without OpenTelemetry or without any traceparent."""
    otel = _otel()
    parents = [p for p in (_text(h.get(TRACEPARENT)) for h in many) if p] if otel else []
    if otel is None or not parents:
        yield
        return
    trace, tracer = _tracer(otel, "consumer")
    with tracer.start_as_current_span(
        name,
        kind=trace.SpanKind.CONSUMER,
        links=_links(otel, parents),
        attributes={**attributes, "messaging.batch.message_count": len(many)},
    ):
        yield


#: OpenTelemetry's SDK keeps at most 128 links per span by default; more are dropped there.
MAX_LINKS = 128


def _tracer(otel: Any, part: str) -> tuple[Any, Any]:
    """OpenTelemetry's trace API and the tracer of ``part`` (consumer, publisher)."""
    _propagate, trace = otel
    return trace, trace.get_tracer(f"outbox-sink.{part}")


def _links(otel: Any, parents: Sequence[str]) -> list[Any]:
    propagate, trace = otel
    links = []
    for parent in parents[:MAX_LINKS]:
        ctx = trace.get_current_span(propagate.extract({TRACEPARENT: parent})).get_span_context()
        if ctx.is_valid:
            links.append(trace.Link(ctx))
    return links


def available() -> bool:
    """Whether OpenTelemetry's API is installed."""
    return _otel() is not None


def producer_span(
    *, name: str, parents: Sequence[str], attributes: Mapping[str, Any], start_ns: int
) -> Any | None:
    """Start (not as the current span) a PRODUCER span at ``start_ns`` (wall clock, ns) linked
    to each ``traceparent`` of ``parents``; the caller ends it. None without OpenTelemetry."""
    otel = _otel()
    if otel is None:
        return None
    trace, tracer = _tracer(otel, "publisher")
    return tracer.start_span(
        name,
        kind=trace.SpanKind.PRODUCER,
        links=_links(otel, parents),
        attributes=dict(attributes),
        start_time=start_ns,
    )


def traceparent_of(headers: str | Mapping[str, Any] | None) -> str | None:
    """The ``traceparent`` in a row's headers (JSON text as the claim reads it, or decoded),
    else None; parses only text that mentions one."""
    if isinstance(headers, str):
        if TRACEPARENT not in headers:
            return None
        try:
            headers = json.loads(headers)
        except ValueError:
            return None
    return _text(headers.get(TRACEPARENT)) if isinstance(headers, Mapping) else None


def _text(value: object) -> str | None:
    """A header value as text (AMQP long strings may arrive as bytes)."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None
