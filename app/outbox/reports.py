"""What a publisher reports about itself in ``outbox_publishers.stats``, as one shape.

The publisher writes a :class:`PublisherReport` with each heartbeat (and at once when the broker
blocks or unblocks it); ``outbox status``, ``GET /v1/stats`` and the console read the same model
back. One class on both sides is the contract: a field renamed here is renamed for both, and
``tests/integration/test_publisher_observability.py`` runs a real publisher and reads its report
through the API.

Counters are the publisher's own, monotonic for a publisher id: a publisher that restarts with the
id of an earlier run starts from that run's last report, so no figure ever goes down.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Counter fields (monotonic per publisher id).
COUNTERS: tuple[str, ...] = (
    "published",
    "confirmed",
    "returned",
    "nacked",
    "nacked_final",
    "retried",
    "failed",
    "poison",
    "lost_confirms",
    "released",
    "channel_closes",
    "connection_closes",
    "reconnects",
    "connect_failures",
    "protocol_errors",
    "destination_errors",
    "lease_lost",
    "claims",
    "claimed",
    "flushes",
    "db_errors",
    "blocked_seconds",
    "destination_outages",
    "postponed",
    "confirm_timeouts",
    "outages_overdue",
    "returns_retried",
)


class PublisherReport(BaseModel):
    """One publisher's figures at its last heartbeat."""

    model_config = ConfigDict(extra="ignore")

    published: int = Field(0, ge=0, description="Publishes sent (republishes included).")
    confirmed: int = Field(0, ge=0, description="Rows confirmed (acked, not returned).")
    returned: int = Field(0, ge=0, description="Rows returned unroutable (mandatory).")
    nacked: int = Field(0, ge=0, description="Nacks received (each row may come back).")
    nacked_final: int = Field(0, ge=0, description="Rows ended nacked (attempts spent).")
    retried: int = Field(0, ge=0, description="Rows put back with backoff (nack, destination).")
    failed: int = Field(0, ge=0, description="Rows ended failed (permanent error, poison).")
    poison: int = Field(0, ge=0, description="Rows failed for closing their channel alone.")
    lost_confirms: int = Field(
        0, ge=0, description="Publishes whose confirm never came: possible duplicates."
    )
    released: int = Field(0, ge=0, description="Claimed rows given back unpublished.")
    channel_closes: int = Field(0, ge=0, description="Confirm channels closed by the broker.")
    connection_closes: int = Field(0, ge=0, description="Connections lost or closed.")
    reconnects: int = Field(0, ge=0, description="Successful reconnects.")
    connect_failures: int = Field(0, ge=0, description="Failed connection attempts.")
    protocol_errors: int = Field(0, ge=0, description="Impossible frames from the broker.")
    destination_errors: int = Field(0, ge=0, description="Missing or forbidden exchanges seen.")
    lease_lost: int = Field(0, ge=0, description="Rows the database no longer let it settle.")
    claims: int = Field(0, ge=0, description="Claim statements that returned rows.")
    claimed: int = Field(0, ge=0, description="Rows claimed.")
    flushes: int = Field(0, ge=0, description="Write-backs committed.")
    db_errors: int = Field(0, ge=0, description="Database calls that failed (retried).")
    blocked_seconds: float = Field(0.0, ge=0, description="Time the broker blocked publishing.")
    destination_outages: int = Field(
        0, ge=0, description="Exchanges paused for nacking everything (no ack for a while)."
    )
    postponed: int = Field(
        0, ge=0, description="Rows put back pending for a destination outage (no budget spent)."
    )
    confirm_timeouts: int = Field(
        0, ge=0, description="Connections dropped for a confirm overdue past confirm_timeout."
    )
    outages_overdue: int = Field(
        0, ge=0, description="Destination outages past destination_outage_max_wait: charged."
    )
    returns_retried: int = Field(
        0, ge=0, description="NO_ROUTE returns within return_grace of connecting: retried."
    )

    connected: bool = Field(False, description="Connected to the broker now.")
    blocked: bool = Field(False, description="The broker blocks publishing now (alarm).")
    blocked_reason: str | None = Field(None, description="The broker's reason when blocked.")
    broker_node: str | None = Field(None, description="host:port of the broker node it uses.")
    broker_unreachable_seconds: float = Field(
        0.0, ge=0, description="Seconds since the broker became unreachable (0 when connected)."
    )
    held: int = Field(0, ge=0, description="Rows held: claimed and not yet settled.")
    queued: int = Field(0, ge=0, description="Rows claimed, not yet published.")
    outstanding: int = Field(0, ge=0, description="Publishes awaiting a broker confirm.")
    quarantined: int = Field(0, ge=0, description="Suspect rows waiting to be published alone.")
    oldest_held_age_seconds: float | None = Field(
        None, ge=0, description="Age of the oldest held row since its claim."
    )
    confirm_latency_p50: float | None = Field(None, ge=0, description="Seconds, this process.")
    confirm_latency_p99: float | None = Field(None, ge=0, description="Seconds, this process.")
    paused_exchanges: list[str] = Field(
        default_factory=list, description="Exchanges backing off (missing or forbidden)."
    )
    metrics_url: str | None = Field(None, description="Where this publisher serves /metrics.")
    version: str | None = Field(None, description="The product version it runs.")


def read_report(raw: Any) -> PublisherReport | None:
    """A stored report, or None when there is none or it does not fit the model."""
    if not isinstance(raw, dict):
        return None
    try:
        return PublisherReport.model_validate(raw)
    except ValidationError:
        return None
