"""Publisher spans (``OUTBOX_PUBLISHER_TRACING``): one OpenTelemetry PRODUCER span per published
batch, from the publish of the batch to the write-back that settles its last row, linked to the
trace of each row that carries a ``traceparent``.

One span per batch, not per message: an SDK span costs about as much CPU as the publisher's
whole work for one row (docs/applications.md), so a span per message would double it. The span's
attributes count how the batch's rows ended (``outbox.confirmed``, ``outbox.returned``, ...); it
ends with an ERROR status when a row failed for good. Off (the default), the publisher makes no
call here.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from app import tracing
from app.outbox.records import ClaimedRow
from app.publisher.outcomes import Outcomes

log = logging.getLogger("app.publisher")
SPAN_NAME = "outbox publish"


@dataclass(slots=True)
class _Batch:
    span: Any
    pending: int
    ended: Counter[str] = field(default_factory=Counter)


def _endings(out: Outcomes) -> Iterator[tuple[str, Iterable[int]]]:
    """How each row settled by ``out`` ended, by the name its span attribute takes."""
    yield "confirmed", out.confirmed
    yield "returned", (r.id for r in out.returned)
    yield "nacked", out.nacked
    yield "released", out.released
    for name, groups in (
        ("lost", out.lost),
        ("failed", out.failed),
        ("destination", out.destination),
    ):
        for ids in groups.values():
            yield name, ids
    for ids in out.postponed.values():
        yield "postponed", ids


class BatchSpans:
    """The open batch spans of one publisher, by the rows still unsettled in each."""

    def __init__(self, *, publisher_id: str, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.publisher_id = publisher_id
        self._wall_ns = wall_ns
        self._open: dict[int, _Batch] = {}
        self.started = self.ended = 0

    def published(self, rows: Sequence[ClaimedRow]) -> None:
        """A batch went out: its span starts now."""
        if not rows:
            return
        parents: list[str] = []
        for row in rows:  # each parent costs a JSON parse: stop at the SDK's link limit
            parent = tracing.traceparent_of(row.headers)
            if parent is not None:
                parents.append(parent)
                if len(parents) == tracing.MAX_LINKS:
                    break
        exchanges = {r.exchange for r in rows}
        attributes: dict[str, Any] = {
            "messaging.system": "rabbitmq",
            "messaging.operation": "publish",
            "messaging.batch.message_count": len(rows),
            "outbox.publisher": self.publisher_id,
        }
        if len(exchanges) == 1:
            attributes["messaging.destination.name"] = next(iter(exchanges))
        span = tracing.producer_span(
            name=SPAN_NAME, parents=parents, attributes=attributes, start_ns=self._wall_ns()
        )
        if span is None:
            return
        self.started += 1
        batch = _Batch(span, pending=len(rows))
        for row in rows:
            self._open[row.id] = batch

    def settled(self, out: Outcomes) -> None:
        """A write-back committed ``out``: rows of open batches ended; a batch whose last row
        ended closes its span."""
        now = None
        for ending, ids in _endings(out):
            for row_id in ids:
                batch = self._open.pop(row_id, None)
                if batch is None:
                    continue
                batch.ended[ending] += 1
                batch.pending -= 1
                if batch.pending == 0:
                    now = now or self._wall_ns()
                    self._finish(batch, now)

    def close(self) -> None:
        """The publisher stops: end every open span, saying how many rows it left unsettled."""
        now = self._wall_ns()
        for batch in {id(b): b for b in self._open.values()}.values():
            batch.ended["unsettled"] = batch.pending
            self._finish(batch, now)
        self._open.clear()

    def _finish(self, batch: _Batch, now: int) -> None:
        span = batch.span
        for ending, count in batch.ended.items():
            span.set_attribute(f"outbox.{ending}", count)
        failed = sum(batch.ended[k] for k in ("failed", "nacked", "returned", "destination"))
        if failed:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, f"{failed} rows not delivered"))
        span.end(end_time=now)
        self.ended += 1

    @property
    def open(self) -> int:
        """Spans started and not ended yet."""
        return self.started - self.ended


def batch_spans(*, enabled: bool, publisher_id: str) -> BatchSpans | None:
    """The publisher's batch spans when ``OUTBOX_PUBLISHER_TRACING`` is on and OpenTelemetry is
    installed; None otherwise (said once in the log when it was asked for)."""
    if not enabled:
        return None
    if not tracing.available():
        log.warning(
            "OUTBOX_PUBLISHER_TRACING is on but OpenTelemetry is not installed "
            "(pip install 'outbox-sink[otel]'): no publisher spans"
        )
        return None
    return BatchSpans(publisher_id=publisher_id)
