"""The consumer kit's settings (:class:`ConsumerConfig`) and figures (:class:`ConsumerMetrics`,
exported by the kit's prometheus collector). Pure: standard library only."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from app.histogram import Histogram

COUNTERS = {
    "deliveries": "Deliveries received (redeliveries included).",
    "redelivered": "Deliveries the broker flagged as redelivered.",
    "handled": "Messages whose handler ran and committed (effect done).",
    "deduplicated": "Deliveries already in the inbox: acked without running the handler.",
    "acked": "Deliveries acknowledged.",
    "ack_frames": "basic.ack frames sent (each may settle many deliveries).",
    "transactions": "Transactions that ran handlers (a window of deliveries, or one message).",
    "handler_failures": "Handlers that raised or ran past handler_timeout (each an attempt).",
    "handler_timeouts": "Handlers that ran past handler_timeout (counted as failed attempts).",
    "requeued": "Failed deliveries requeued (below the delivery limit).",
    "dead_lettered": "Deliveries dead-lettered (delivery limit reached, or no message_id).",
    "broker_limited": "Deliveries dead-lettered because a quorum queue's x-delivery-count "
    "reached broker_delivery_limit.",
    "database_errors": "Database calls that failed (each retried, none against a message).",
    "database_outages": "Times consumption paused because the database stopped answering.",
    "cancels": "Consumers cancelled by the broker (queue deleted).",
    "reconnects": "Connections lost and opened again (the broker's, and the database's after an "
    "outage).",
}
LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: A window whose running handler has taken this long gives the deliveries it has not started
#: to another window.
CUT_AFTER = 0.25
#: A window holds about this much handler time at most: slow handlers get smaller windows,
#: spread over the handler threads (fast ones fill ``batch_size``).
WINDOW_SECONDS = 0.2


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    name: str  # the inbox key: consumers of the same name share effects
    queue: str
    #: ``batch``: windows of first deliveries in one transaction each; ``message``: a
    #: transaction per message (for handlers whose effect is outside the database)
    mode: Literal["batch", "message"] = "batch"
    prefetch: int = 400
    concurrency: int = 8
    #: deliveries per window at most (and at most half the prefetch)
    batch_size: int = 200
    delivery_limit: int = 5
    #: a quorum queue's ``x-delivery-count`` at or above this dead-letters the delivery (with
    #: the kit's headers) before its handler runs: the broker's count sees tries the attempts
    #: table cannot, but it also counts every delivery a crash returned, so keep it well above
    #: ``delivery_limit`` and below the queue's ``x-delivery-limit`` (None: not used)
    broker_delivery_limit: int | None = 50
    #: a handler running longer fails its message's attempt (None: no limit)
    handler_timeout: float | None = 60.0
    ack_interval: float = 0.05
    #: one basic.ack(multiple) per finished run (default), or one ack per delivery
    ack_multiple: bool = True
    stop_timeout: float = 10.0
    reconnect_max_delay: float = 10.0
    #: the longest pause between two tries while the database is down
    database_retry_max_delay: float = 10.0
    #: dead letters are published here (with headers saying why) and the delivery acked; None:
    #: rejected without requeue (the queue's own x-dead-letter-exchange, if any, takes them)
    dead_letter_exchange: str | None = None
    #: routing key for ``dead_letter_exchange`` (None: the message's own routing key)
    dead_letter_routing_key: str | None = None

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be at least 1"
            for name, value in (
                ("prefetch", self.prefetch),
                ("concurrency", self.concurrency),
                ("delivery_limit", self.delivery_limit),
                ("batch_size", self.batch_size),
            )
            if value < 1
        ]
        if not self.name.strip() or not self.queue.strip():
            problems.append("name and queue must not be empty")
        if self.mode not in ("batch", "message"):
            problems.append(f"mode must be 'batch' or 'message', not {self.mode!r}")
        if self.handler_timeout is not None and self.handler_timeout <= 0:
            problems.append("handler_timeout must be positive (or None)")
        if self.broker_delivery_limit is not None and self.broker_delivery_limit < 1:
            problems.append("broker_delivery_limit must be at least 1 (or None)")
        if problems:
            raise ValueError("invalid consumer config: " + "; ".join(problems))


@dataclass
class ConsumerMetrics:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    handler_seconds: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS))
    in_flight: int = 0
    prefetch: int = 0
    connected: bool = False
    database_down: bool = False
    #: when the oldest handler still running started (monotonic), abandoned ones included
    oldest_handler_started: Callable[[], float | None] = lambda: None
    abandoned_handlers: int = 0

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def oldest_handler_seconds(self) -> float:
        started = self.oldest_handler_started()
        return 0.0 if started is None else max(0.0, time.monotonic() - started)
