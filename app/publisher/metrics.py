"""One publisher's own figures: plain counters mutated on the event loop, exported from a
prometheus_client registry of its own, and reported to the database as a
:class:`~app.outbox.reports.PublisherReport`.

Counters only go up, for the life of a publisher id: :meth:`PublisherMetrics.resume` adds the
last report of an earlier run with the same id, so a restart never lowers one. Histograms take
bulk observations (:meth:`Histogram.observe_many`): a ``multiple`` ack that settles 500 rows
published in one write is one call, and the histogram's count is still the number of rows.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

import app
from app.histogram import Histogram
from app.outbox.reports import COUNTERS, PublisherReport

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
DB_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """What a publisher run did, as returned by :func:`app.publisher.service.run_publisher`."""

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
    nacked_final: int = 0

    @property
    def ended_badly(self) -> int:
        """Rows this run ended ``failed``, ``returned`` or ``nacked``: an operator's work."""
        return self.failed + self.returned + self.nacked_final


class PublisherMetrics:
    """Counters (monotonic), gauges and histograms of one publisher; event loop only.

    Counter names are :data:`app.outbox.reports.COUNTERS` (``lost_confirms`` is also reachable
    as ``lost``). Gauges are read at scrape time from the engine through ``gauges``.
    """

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        for name in COUNTERS:
            setattr(self, name, 0.0 if name == "blocked_seconds" else 0)
        self.blocked_since: float | None = None
        self.blocked_reason: str | None = None
        self.connected = False
        self.blocked = False
        #: ``host:port`` of the broker node of the current connection (a cluster's node)
        self.broker_node: str | None = None
        self.confirm_latency = Histogram(LATENCY_BUCKETS)
        self.flush_seconds = Histogram(DB_BUCKETS)
        self.claim_seconds = Histogram(DB_BUCKETS)
        #: claims that returned rows the running write-back settled, and waited for it
        self.claim_wait_seconds = Histogram(DB_BUCKETS)
        self._base: dict[str, float] = {}
        #: set by the engine: current gauge values (held, queued, outstanding, ...)
        self.gauges: Callable[[], dict[str, float | None]] = dict
        #: set by the service: the stream relay's counts (app.streams.relay.StreamStats)
        self.streams: object | None = None
        #: set by the service when settling by ranges: app.outbox.ranged.RangeCounts
        self.ranges: object | None = None

    # the counters, typed for mypy (set in __init__ from COUNTERS)
    published: int
    confirmed: int
    returned: int
    nacked: int
    nacked_final: int
    retried: int
    failed: int
    poison: int
    lost_confirms: int
    released: int
    channel_closes: int
    connection_closes: int
    reconnects: int
    connect_failures: int
    protocol_errors: int
    destination_errors: int
    lease_lost: int
    claims: int
    claimed: int
    flushes: int
    db_errors: int
    blocked_seconds: float
    destination_outages: int
    postponed: int
    confirm_timeouts: int
    outages_overdue: int
    returns_retried: int
    claims_retried: int
    confirms_rewritten: int

    @property
    def lost(self) -> int:
        return self.lost_confirms

    @lost.setter
    def lost(self, value: int) -> None:
        self.lost_confirms = value

    def resume(self, previous: PublisherReport | None) -> None:
        """Continue the counters of an earlier run of the same publisher id."""
        if previous is not None:
            self._base = {name: float(getattr(previous, name)) for name in COUNTERS}

    def total(self, name: str) -> float:
        """A counter as exported: this run's value plus the earlier runs' of the same id."""
        value = float(getattr(self, name))
        if name == "blocked_seconds" and self.blocked_since is not None:
            value += time.monotonic() - self.blocked_since
        return value + self._base.get(name, 0.0)

    def set_blocked(
        self, blocked: bool, *, reason: str | None = None, now: float | None = None
    ) -> None:
        now = time.monotonic() if now is None else now
        if blocked and self.blocked_since is None:
            self.blocked_since = now
        elif not blocked and self.blocked_since is not None:
            self.blocked_seconds += now - self.blocked_since
            self.blocked_since = None
        self.blocked = blocked
        self.blocked_reason = reason if blocked else None

    def report(self, **extra: object) -> PublisherReport:
        """The figures as ``outbox_publishers.stats`` stores them."""
        gauges = self.gauges()
        values: dict[str, object] = {name: self.total(name) for name in COUNTERS}
        values.update(
            connected=self.connected,
            blocked=self.blocked,
            blocked_reason=self.blocked_reason,
            broker_node=self.broker_node,
            confirm_latency_p50=self.confirm_latency.quantile(0.5),
            confirm_latency_p99=self.confirm_latency.quantile(0.99),
            version=app.__version__,
            **gauges,
            **extra,
        )
        return PublisherReport.model_validate(values)

    def stats(self) -> PublisherStats:
        return PublisherStats(
            published=self.published,
            confirmed=self.confirmed,
            returned=self.returned,
            nacked=self.nacked,
            retried=self.retried,
            failed=self.failed,
            lost=self.lost_confirms,
            released=self.released,
            protocol_errors=self.protocol_errors,
            channel_closes=self.channel_closes,
            reconnects=self.reconnects,
            lease_lost=self.lease_lost,
            elapsed_seconds=time.monotonic() - self.started_at,
            nacked_final=self.nacked_final,
        )


#: counter -> (metric name without _total, help); every counter of COUNTERS is exported
COUNTER_HELP: dict[str, str] = {
    "published": "Publishes sent to the broker (republishes included).",
    "confirmed": "Rows the broker confirmed (acked, not returned).",
    "returned": "Mandatory publishes returned unroutable (rows ended returned).",
    "nacked": "Nacks received from the broker.",
    "nacked_final": "Rows ended nacked (attempts spent).",
    "retried": "Rows put back with backoff after a nack or a destination error.",
    "failed": "Rows ended failed (permanent error or poison).",
    "poison": "Rows failed for closing their channel or connection when published alone.",
    "lost_confirms": "Publishes whose confirm never came, or came for a row this publisher no "
    "longer held (published again: possible duplicates).",
    "released": "Claimed rows given back unpublished.",
    "channel_closes": "Confirm channels closed by the broker.",
    "connection_closes": "Broker connections lost or closed.",
    "reconnects": "Successful reconnects to the broker.",
    "connect_failures": "Failed connection attempts.",
    "protocol_errors": "Impossible frames from the broker (unknown delivery tags, returns).",
    "destination_errors": "Missing or forbidden exchanges seen.",
    "lease_lost": "Rows the database no longer let this publisher settle.",
    "claims": "Claim statements that returned rows.",
    "claimed": "Rows claimed.",
    "flushes": "Write-backs committed (one transaction each).",
    "db_errors": "Database calls that failed and were retried.",
    "blocked_seconds": "Time the broker blocked publishing (resource alarm).",
    "destination_outages": "Exchanges paused because they nacked publishes and acked none for "
    "destination_outage_after (no quorum, a full reject-publish queue).",
    "postponed": "Rows put back pending for a destination outage (no nack budget spent).",
    "confirm_timeouts": "Connections dropped because a confirm was overdue (confirm_timeout).",
    "outages_overdue": "Destination outages that lasted past destination_outage_max_wait: "
    "their rows spend their nack budget from then on.",
    "claims_retried": "Claims run again at once because the server ended their session for "
    "sitting idle in its transaction past 0.5 s (the publisher was paused: GC, CPU, VM).",
    "confirms_rewritten": "Confirms written again after a database failover or crash undid "
    "the write-back (the row found pending or back in flight): not published again.",
    "returns_retried": "Publishes returned NO_ROUTE within return_grace of connecting (bindings "
    "not recovered yet), put back to be published again.",
}
RANGE_HELP: dict[str, str] = {
    "claimed": "Ranges claimed (OUTBOX_SETTLEMENT=ranges).",
    "members": "Rows published as a range's members.",
    "settled": "Ranges settled by the confirms of all their members.",
    "settle_lost": "Ranges whose settle found them no longer this publisher's (lease lost).",
    "adopted": "Range members handed to the row path for an outcome other than a confirm.",
    "expired": "Ranges of dead publishers (or orphaned) closed, their members handed back.",
    "expired_rows": "Rows handed back from expired or orphaned ranges (possible duplicates).",
}
GAUGE_HELP: dict[str, str] = {
    "held": "Rows held: claimed and not yet settled in the database.",
    "queued": "Rows claimed and not yet published.",
    "outstanding": "Publishes awaiting a broker confirm.",
    "quarantined": "Suspect rows waiting to be published alone.",
    "oldest_held_age_seconds": "Age of the oldest held row since its claim (0 when none).",
    "window": "Most rows held at once (OUTBOX_WINDOW).",
    "broker_unreachable_seconds": "Seconds since the broker became unreachable (connection lost "
    "and reconnects failing); 0 when connected.",
}


class PublisherCollector(Collector):
    """Yields one publisher's metric families at scrape time (labels: ``publisher``)."""

    def __init__(self, metrics: PublisherMetrics, *, publisher_id: str) -> None:
        self.m = metrics
        self.publisher_id = publisher_id

    def collect(self) -> Iterator[Metric]:
        m, label = self.m, [self.publisher_id]
        for name in COUNTERS:
            family = CounterMetricFamily(
                f"outbox_publisher_{name}", COUNTER_HELP[name], labels=["publisher"]
            )
            family.add_metric(label, m.total(name))
            yield family
        gauges = m.gauges()
        for name, doc in GAUGE_HELP.items():
            gauge = GaugeMetricFamily(f"outbox_publisher_{name}", doc, labels=["publisher"])
            gauge.add_metric(label, float(gauges.get(name) or 0.0))
            yield gauge
        for name, value, doc in (
            ("connected", m.connected, "1 while connected to the broker."),
            ("blocked", m.blocked, "1 while the broker blocks publishing (resource alarm)."),
        ):
            flag = GaugeMetricFamily(f"outbox_publisher_{name}", doc, labels=["publisher"])
            flag.add_metric(label, 1.0 if value else 0.0)
            yield flag
        yield from self._histograms(label)
        yield from self._streams(label)
        yield from self._ranges(label)
        info = InfoMetricFamily(
            "outbox_publisher_build", "Version of the running publisher.", labels=["publisher"]
        )
        info.add_metric(label, {"version": app.__version__, "python": platform.python_version()})
        yield info
        node = InfoMetricFamily(
            "outbox_publisher_broker_node",
            "The broker node of the current (or last) connection.",
            labels=["publisher"],
        )
        node.add_metric(label, {"node": m.broker_node or ""})
        yield node

    def _ranges(self, label: list[str]) -> Iterator[Metric]:
        """Settling by ranges (``outbox_publisher_range_*``), when this publisher does."""
        counts = self.m.ranges
        if counts is None:
            return
        for name, doc in RANGE_HELP.items():
            family = CounterMetricFamily(
                f"outbox_publisher_range_{name}", doc, labels=["publisher"]
            )
            family.add_metric(label, float(getattr(counts, name)))
            yield family

    def _streams(self, label: list[str]) -> Iterator[Metric]:
        """The stream relay's figures (``outbox_publisher_stream_*``), when it runs."""
        stats = self.m.streams
        if stats is None:
            return
        for name, (kind, doc) in STREAM_HELP.items():
            value = float(getattr(stats, name, 0) or 0)
            family: Metric
            if kind == "counter":
                family = CounterMetricFamily(
                    f"outbox_publisher_stream_{name}", doc, labels=["publisher"]
                )
            else:
                family = GaugeMetricFamily(
                    f"outbox_publisher_stream_{name}", doc, labels=["publisher"]
                )
            family.add_metric(label, value)
            yield family

    def _histograms(self, label: list[str]) -> Iterator[Metric]:
        m = self.m
        for name, hist, doc in (
            (
                "confirm_latency_seconds",
                m.confirm_latency,
                "Publish (socket write) to broker confirm, per confirmed row.",
            ),
            ("flush_seconds", m.flush_seconds, "Write-back transaction time."),
            ("claim_seconds", m.claim_seconds, "Claim statement time."),
            (
                "claim_wait_seconds",
                m.claim_wait_seconds,
                "Time a claim waited for the running write-back to settle rows it returned.",
            ),
        ):
            family = HistogramMetricFamily(f"outbox_publisher_{name}", doc, labels=["publisher"])
            family.add_metric(label, hist.cumulative(), sum_value=hist.sum)
            yield family


#: The stream relay's figures: name -> (kind, help).
STREAM_HELP = {
    "published": ("counter", "Rows published into streams (first sends and resends)."),
    "confirmed": ("counter", "Stream rows confirmed by a publish confirm."),
    "settled_by_sequence": (
        "counter",
        "Stream rows the broker already had when their lane resumed: confirmed by the broker's "
        "last stored publishing id, never published again.",
    ),
    "resent": (
        "counter",
        "Stream rows sent again under their publishing id after a resume (the broker drops "
        "those it has).",
    ),
    "failed": ("counter", "Stream rows ended failed (not a message, or the stream missing)."),
    "takeovers": ("counter", "Lanes taken over from a publisher whose lease expired."),
    "reconnects": ("counter", "Stream sessions ended and started again (cuts, publish errors)."),
    "lanes_held": ("gauge", "Stream lanes this publisher holds."),
    "outstanding": ("gauge", "Stream publishes sent and not yet confirmed."),
}


def registry_for(metrics: PublisherMetrics, *, publisher_id: str) -> CollectorRegistry:
    """A registry of this publisher's own (never prometheus_client's global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PublisherCollector(metrics, publisher_id=publisher_id))
    return registry
