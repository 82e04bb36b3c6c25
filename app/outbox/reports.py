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
    "claims_retried",
    "confirms_rewritten",
)


def _figure(default: float | None, description: str) -> Any:
    """A figure of the report: never below 0, ``default`` until the publisher reports it."""
    return Field(default, ge=0, description=description)


class PublisherReport(BaseModel):
    """One publisher's figures at its last heartbeat."""

    model_config = ConfigDict(extra="ignore")

    published: int = _figure(0, "Publishes sent (republishes included).")
    confirmed: int = _figure(0, "Rows confirmed (acked, not returned).")
    returned: int = _figure(0, "Rows returned unroutable (mandatory).")
    nacked: int = _figure(0, "Nacks received (each row may come back).")
    nacked_final: int = _figure(0, "Rows ended nacked (attempts spent).")
    retried: int = _figure(0, "Rows put back with backoff (nack, destination).")
    failed: int = _figure(0, "Rows ended failed (permanent error, poison).")
    poison: int = _figure(0, "Rows failed for closing their channel alone.")
    lost_confirms: int = _figure(0, "Publishes whose confirm never came: possible duplicates.")
    released: int = _figure(0, "Claimed rows given back unpublished.")
    channel_closes: int = _figure(0, "Confirm channels closed by the broker.")
    connection_closes: int = _figure(0, "Connections lost or closed.")
    reconnects: int = _figure(0, "Successful reconnects.")
    connect_failures: int = _figure(0, "Failed connection attempts.")
    protocol_errors: int = _figure(0, "Impossible frames from the broker.")
    destination_errors: int = _figure(0, "Missing or forbidden exchanges seen.")
    lease_lost: int = _figure(0, "Rows the database no longer let it settle.")
    claims: int = _figure(0, "Claim statements that returned rows.")
    claimed: int = _figure(0, "Rows claimed.")
    flushes: int = _figure(0, "Write-backs committed.")
    db_errors: int = _figure(0, "Database calls that failed (retried).")
    blocked_seconds: float = _figure(0.0, "Time the broker blocked publishing.")
    destination_outages: int = _figure(
        0, "Exchanges paused for nacking everything (no ack for a while)."
    )
    postponed: int = _figure(0, "Rows put back pending for a destination outage (no budget spent).")
    confirm_timeouts: int = _figure(
        0, "Connections dropped for a confirm overdue past confirm_timeout."
    )
    outages_overdue: int = _figure(
        0, "Destination outages past destination_outage_max_wait: charged."
    )
    returns_retried: int = _figure(
        0, "NO_ROUTE returns within return_grace of connecting: retried."
    )
    claims_retried: int = _figure(
        0, "Claims run again after the server ended their session (a paused process)."
    )
    confirms_rewritten: int = _figure(
        0, "Confirms written again after a failover or crash undid them: no republish."
    )

    connected: bool = Field(False, description="Connected to the broker now.")
    blocked: bool = Field(False, description="The broker blocks publishing now (alarm).")
    blocked_reason: str | None = Field(None, description="The broker's reason when blocked.")
    broker_node: str | None = Field(None, description="host:port of the broker node it uses.")
    broker_unreachable_seconds: float = _figure(
        0.0, "Seconds since the broker became unreachable (0 when connected)."
    )
    held: int = _figure(0, "Rows held: claimed and not yet settled.")
    queued: int = _figure(0, "Rows claimed, not yet published.")
    outstanding: int = _figure(0, "Publishes awaiting a broker confirm.")
    quarantined: int = _figure(0, "Suspect rows waiting to be published alone.")
    oldest_held_age_seconds: float | None = _figure(
        None, "Age of the oldest held row since its claim."
    )
    confirm_latency_p50: float | None = _figure(None, "Seconds, this process.")
    confirm_latency_p99: float | None = _figure(None, "Seconds, this process.")
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
