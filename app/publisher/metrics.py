"""In-process counters of one publisher: plain attributes, read by the /metrics endpoint."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """What a publisher run did, as returned by :func:`app.publisher.run_publisher`."""

    published: int
    confirmed: int
    returned: int
    nacked: int
    retried: int
    failed: int
    lost: int
    released: int
    protocol_errors: int
    channel_closes: int
    reconnects: int
    lease_lost: int
    elapsed_seconds: float

    @property
    def confirmed_per_second(self) -> float:
        return self.confirmed / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0


class PublisherMetrics:
    """Monotonic counters and a few gauges; the engine mutates them from the event loop only.

    Counters: ``published`` (basic.publish sent, republishes included), ``confirmed``,
    ``returned``, ``nacked`` (nacks received), ``retried`` (rows put back with backoff after a nack
    or a destination error), ``failed`` (rows ended ``failed``), ``lost`` (publishes whose confirm
    never came: channel/connection lost; each is republished, a possible duplicate), ``released``
    (claimed rows given back unpublished), ``protocol_errors`` (impossible broker frames),
    ``channel_closes``, ``reconnects``, ``destination_errors``, ``lease_lost`` (rows the DB no
    longer let this publisher settle), ``claims``/``claimed``, ``flushes``, ``blocked_seconds``.
    Gauges: ``connected``, ``blocked``, ``held`` (rows claimed and not yet settled in the DB),
    ``outstanding`` (publishes awaiting a confirm). ``confirm_latency`` keeps recent samples in
    seconds.
    """

    def __init__(self, *, samples: int = 4096) -> None:
        self.started_at = time.monotonic()
        self.published = 0
        self.confirmed = 0
        self.returned = 0
        self.nacked = 0
        self.retried = 0
        self.failed = 0
        self.lost = 0
        self.released = 0
        self.protocol_errors = 0
        self.channel_closes = 0
        self.reconnects = 0
        self.connect_failures = 0
        self.destination_errors = 0
        self.lease_lost = 0
        self.claims = 0
        self.claimed = 0
        self.flushes = 0
        self.db_errors = 0
        self.blocked_seconds = 0.0
        self.blocked_since: float | None = None
        self.connected = False
        self.blocked = False
        self.held = 0
        self.outstanding = 0
        self.confirm_latency: deque[float] = deque(maxlen=samples)

    def observe_confirm_latency(self, seconds: float) -> None:
        self.confirm_latency.append(seconds)

    def set_blocked(self, blocked: bool, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if blocked and self.blocked_since is None:
            self.blocked_since = now
        elif not blocked and self.blocked_since is not None:
            self.blocked_seconds += now - self.blocked_since
            self.blocked_since = None
        self.blocked = blocked

    def latency_quantile(self, q: float) -> float | None:
        """A quantile (0..1) of the recent confirm latencies, or None without samples."""
        if not self.confirm_latency:
            return None
        ordered = sorted(self.confirm_latency)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def as_stats(self, *, now: float | None = None) -> dict[str, float]:
        """The counters as the publisher registry stores them (``outbox_publishers.stats``,
        read by ``/metrics``): monotonic per publisher, ``lost_confirms`` for ``lost``."""
        now = time.monotonic() if now is None else now
        blocked = self.blocked_seconds
        if self.blocked_since is not None:
            blocked += now - self.blocked_since
        p50, p99 = self.latency_quantile(0.5), self.latency_quantile(0.99)
        return {
            "published": self.published, "confirmed": self.confirmed, "nacked": self.nacked,
            "returned": self.returned, "failed": self.failed, "lost_confirms": self.lost,
            "channel_closes": self.channel_closes, "reconnects": self.reconnects,
            "protocol_errors": self.protocol_errors, "blocked_seconds": round(blocked, 3),
            "retried": self.retried, "released": self.released,
            "destination_errors": self.destination_errors, "lease_lost": self.lease_lost,
            "connect_failures": self.connect_failures, "claimed": self.claimed,
            "held": self.held, "outstanding": self.outstanding,
            "confirm_latency_p50": p50 if p50 is not None else -1.0,
            "confirm_latency_p99": p99 if p99 is not None else -1.0,
        }  # fmt: skip

    def stats(self) -> PublisherStats:
        return PublisherStats(
            published=self.published, confirmed=self.confirmed, returned=self.returned,
            nacked=self.nacked, retried=self.retried, failed=self.failed, lost=self.lost,
            released=self.released, protocol_errors=self.protocol_errors,
            channel_closes=self.channel_closes, reconnects=self.reconnects,
            lease_lost=self.lease_lost, elapsed_seconds=time.monotonic() - self.started_at,
        )  # fmt: skip
