"""``python -m bench.traced_publisher [--until-empty]``: ``python -m app.publisher`` under
OpenTelemetry's SDK, as a traced deployment runs it: a TracerProvider with a BatchSpanProcessor
whose exporter drops the spans (the cost of making, linking, ending and batching each span is
measured; a network exporter's is the deployment's own). The bench's
``drain_postgres_publisher_tracing`` runs it with ``OUTBOX_PUBLISHER_TRACING=true``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult


class _Drop(SpanExporter):
    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def _run(argv: list[str]) -> int:
    from app.publisher.__main__ import _cli

    exporter = _Drop()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    try:
        return _cli(argv)
    finally:
        provider.shutdown()
        print(f"spans exported: {exporter.spans}", flush=True)


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
