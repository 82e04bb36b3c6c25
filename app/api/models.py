"""Request and response bodies of the REST API (and of the CLI's ``--json`` output).

Every request field is constrained so that bad input is a 422 naming the field, never a database
error: strings are bounded and free of control characters, numbers are bounded, datetimes carry a
timezone.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from app.outbox import queries
from app.outbox.reports import PublisherReport
from app.outbox.repository import (
    CONTROL_CHARACTERS,
    MAX_ACTOR,
    OPERATOR_TEXT_FORBIDDEN,
    RepublishFilter,
    RepublishResult,
)
from app.outbox.states import Status

#: No control characters (PostgreSQL text refuses NUL), bounded length.
TEXT_PATTERN = rf"^[^{CONTROL_CHARACTERS}]+$"
#: An operator's text (a skip reason): no controls, C1 included, line separators or bidi controls.
OPERATOR_TEXT_PATTERN = rf"^[^{OPERATOR_TEXT_FORBIDDEN}]+$"
CURSOR_PATTERN = r"^[A-Za-z0-9_-]+$"
#: An actor name or request id: printable ASCII, no leading space.
TOKEN_PATTERN = r"^[!-~][ -~]*$"
MAX_REPUBLISH_LIMIT = 100_000
MAX_AGE_SECONDS = 10 * 365 * 86400


def utf8_text(value: str) -> str:
    value.encode()  # lone surrogates raise here (UnicodeEncodeError is a ValueError)
    return value


Text = Annotated[
    str, Field(min_length=1, max_length=1024, pattern=TEXT_PATTERN), AfterValidator(utf8_text)
]
Cursor = Annotated[str, Field(min_length=4, max_length=2048, pattern=CURSOR_PATTERN)]
RequestId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=TOKEN_PATTERN,
        description="Operator-chosen id of this action; repeating it replays the first result.",
    ),
]
Actor = Annotated[str, Field(min_length=1, max_length=MAX_ACTOR, pattern=TOKEN_PATTERN)]
RepublishStatus = Literal["returned", "nacked", "failed"]
ALL_REPUBLISH_STATUSES: list[RepublishStatus] = ["failed", "nacked", "returned"]


def _to_utc(value: dt.datetime | None) -> dt.datetime | None:
    if value is None:
        return None
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise ValueError("datetime out of range once converted to UTC") from None


_NUMBER = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _text_only(value: object) -> object:
    """A string, and not a number in a string (pydantic would read it as a Unix time)."""
    if not isinstance(value, str) or _NUMBER.fullmatch(value):
        raise ValueError("expected an ISO 8601 date-time string with a timezone")
    return value


#: An ISO 8601 string with a timezone (not a number), converted to UTC.
UtcDatetime = Annotated[
    AwareDatetime, Field(strict=False), BeforeValidator(_text_only), AfterValidator(_to_utc)
]


class ErrorBody(BaseModel):
    detail: str = Field(description="What is wrong with the request, or what is unavailable.")


# ------------------------------------------------------------------------------ stats


class StatusCounts(BaseModel):
    pending: int
    in_flight: int
    confirmed: int
    returned: int
    nacked: int
    failed: int

    @classmethod
    def of(cls, counts: dict[Status, int]) -> StatusCounts:
        return cls(**{s.value: counts.get(s, 0) for s in Status})


class ConfirmLatency(BaseModel):
    window_seconds: float
    samples: int = Field(description="Confirms in the window the percentiles come from.")
    p50: float | None
    p90: float | None
    p99: float | None


class PublisherOut(BaseModel):
    publisher_id: str
    hostname: str
    pid: int
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    stopped_at: dt.datetime | None
    alive: bool
    blocked: bool = Field(description="The broker blocks this live publisher (resource alarm).")
    report: PublisherReport | None = Field(
        description="The publisher's own figures at its last heartbeat."
    )


class StatsOut(BaseModel):
    at: dt.datetime
    counts: StatusCounts
    total: int
    confirmed_estimated: bool = Field(
        description="counts.confirmed (and total) is PostgreSQL's estimate: an outbox over "
        "200,000 rows is not counted row by row; every other count is exact."
    )
    oldest_pending_age_seconds: float | None = Field(
        description="Seconds since the oldest pending row was written."
    )
    oldest_in_flight_age_seconds: float | None = Field(
        description="Seconds since the oldest unconfirmed publish was sent."
    )
    confirm_latency: ConfirmLatency
    possible_duplicates: int = Field(
        description="Publishes repeated after an unknown outcome (lost confirms), over all rows."
    )
    operator_republished: int = Field(description="Rows operators moved back to pending.")
    parked: int = Field(
        default=0,
        description="Pending rows parked by the Spark data source (fail mode) for a batch not "
        "committed yet; rows a driver left when it died between the tasks and the commit stay "
        "here until the batch is run again. Counted in counts.pending.",
    )
    oldest_parked_age_seconds: float | None = Field(
        default=None, description="Seconds since the oldest parked row was written."
    )
    publishers_alive: int
    broker_blocked: bool = Field(
        description="A live publisher reports the broker blocking it (memory or disk alarm)."
    )
    publishers: list[PublisherOut]

    @classmethod
    def of(cls, s: queries.OutboxStats) -> StatsOut:
        lat = s.confirm_latency
        return cls(
            at=s.at, counts=StatusCounts.of(s.counts), total=sum(s.counts.values()),
            confirmed_estimated=s.confirmed_estimated,
            oldest_pending_age_seconds=s.oldest_pending_age_seconds,
            oldest_in_flight_age_seconds=s.oldest_in_flight_age_seconds,
            confirm_latency=ConfirmLatency(
                window_seconds=lat.window_seconds, samples=lat.samples,
                p50=lat.p50, p90=lat.p90, p99=lat.p99,
            ),
            possible_duplicates=s.possible_duplicates,
            operator_republished=s.operator_republished, publishers_alive=s.publishers_alive,
            parked=s.parked, oldest_parked_age_seconds=s.oldest_parked_age_seconds,
            broker_blocked=bool(s.blocked_publishers),
            publishers=[
                PublisherOut(
                    publisher_id=p.publisher_id, hostname=p.hostname, pid=p.pid,
                    started_at=p.started_at, heartbeat_at=p.heartbeat_at,
                    stopped_at=p.stopped_at, alive=p.alive, blocked=p.blocked, report=p.report,
                )
                for p in s.publishers
            ],
        )  # fmt: skip


# ---------------------------------------------------------------- outstanding confirms


class OutstandingOut(BaseModel):
    id: int
    message_id: str
    batch_id: str
    publisher: str = Field(description="The publisher holding the row's lease.")
    channel_id: int | None = Field(description="None until the publish went out.")
    delivery_tag: int | None = Field(description="Publish sequence number on that channel.")
    attempt: int
    max_attempts: int
    exchange: str
    routing_key: str
    published_at: dt.datetime | None = Field(description="None while claimed, not yet sent.")
    claimed_at: dt.datetime | None = Field(description="When this attempt was claimed.")
    age_seconds: float | None = Field(
        description="Seconds since this attempt was published (since its claim while unsent)."
    )
    lease_until: dt.datetime
    lost_confirms: int

    @classmethod
    def of(cls, o: queries.OutstandingConfirm) -> OutstandingOut:
        return cls(**{name: getattr(o, name) for name in cls.model_fields})


class OutstandingPage(BaseModel):
    items: list[OutstandingOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null at end.")


# ---------------------------------------------------------------------------- batches


class BatchOut(BaseModel):
    batch_id: str
    sink: str | None
    spark_batch_id: int | None
    query_id: str | None
    committed_at: dt.datetime | None
    row_count: int | None = Field(description="Rows the Spark batch wrote (outbox_batches).")
    rejected_count: int | None
    rows: int = Field(description="Outbox rows now present with this batch id.")
    counts: StatusCounts
    first_created_at: dt.datetime | None
    first_published_at: dt.datetime | None
    last_published_at: dt.datetime | None
    first_confirmed_at: dt.datetime | None
    last_confirmed_at: dt.datetime | None
    republished: int = Field(
        description="Publishes repeated after an unknown outcome (possible duplicates)."
    )

    @classmethod
    def of(cls, b: queries.BatchSummary) -> BatchOut:
        values: dict[str, Any] = {n: getattr(b, n) for n in cls.model_fields if n != "counts"}
        return cls(**values, counts=StatusCounts.of(b.counts))


class BatchPage(BaseModel):
    items: list[BatchOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null at end.")


# ---------------------------------------------------------------------------- messages


class MessageOut(BaseModel):
    id: int
    message_id: str
    batch_id: str
    exchange: str
    routing_key: str
    mandatory: bool
    content_type: str | None
    headers: dict[str, Any] | None
    properties: dict[str, Any] | None
    ordering_key: str | None
    status: Status
    attempts: int
    max_attempts: int
    nacks: int = Field(0, description="Broker nacks of this row (its nack budget: max_attempts).")
    lost_confirms: int
    available_at: dt.datetime
    lease_owner: str | None
    lease_until: dt.datetime | None
    claimed_at: dt.datetime | None
    channel_id: int | None
    delivery_tag: int | None
    created_at: dt.datetime
    published_at: dt.datetime | None
    confirmed_at: dt.datetime | None
    last_error: str | None
    reply_code: int | None
    reply_text: str | None
    body_size: int
    body_base64: str | None = Field(description="The body, only with `include_body=true`.")

    @classmethod
    def of(cls, m: queries.MessageRecord) -> MessageOut:
        values: dict[str, Any] = {n: getattr(m, n) for n in cls.model_fields if n != "body_base64"}
        body = base64.b64encode(m.body).decode() if m.body is not None else None
        return cls(**values, body_base64=body)


# --------------------------------------------------------------------------- republish


class _RepublishBase(BaseModel):
    """Strict: no coercion ("5" is not a number, 1 is not true), no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: RequestId
    statuses: list[RepublishStatus] = Field(
        default_factory=lambda: list(ALL_REPUBLISH_STATUSES), min_length=1, max_length=3
    )
    limit: int = Field(default=1000, ge=1, le=MAX_REPUBLISH_LIMIT, description="Most rows moved.")
    dry_run: bool = Field(default=False, description="Count and sample only; change nothing.")


class BatchRepublishRequest(_RepublishBase):
    """Republish the terminal failures of one batch."""

    def to_filter(self, batch_id: str) -> RepublishFilter:
        return RepublishFilter(batch_id=batch_id, statuses=frozenset(map(Status, self.statuses)))


class RepublishRequest(_RepublishBase):
    """Republish terminal failures matching a filter (all given conditions hold)."""

    batch_id: Text | None = None
    exchange: Text | None = None
    created_after: UtcDatetime | None = Field(default=None, description="Inclusive.")
    created_before: UtcDatetime | None = Field(default=None, description="Exclusive.")
    ordering_key: Text | None = Field(
        default=None, description="The rows of one ordering key: republish a parked key's "
        "blocking row, the key resumes behind it.")  # fmt: skip
    all_failures: bool = Field(
        default=False, alias="all", description="Set to true to republish every terminal "
        "failure: a request without any filter is refused, so that an empty body never moves "
        "everything.")  # fmt: skip

    @model_validator(mode="after")
    def _range(self) -> RepublishRequest:
        filters = (self.batch_id, self.exchange, self.created_after, self.created_before,
                   self.ordering_key)  # fmt: skip
        unfiltered = all(f is None for f in filters) and "statuses" not in self.model_fields_set
        if unfiltered and not self.all_failures:
            raise ValueError(
                "say what to republish: a filter (batch_id, exchange, statuses, created_after/"
                'created_before, ordering_key) or "all": true'
            )
        after, before = self.created_after, self.created_before
        if after is not None and before is not None and after >= before:
            raise ValueError("created_after must be earlier than created_before")
        return self

    def to_filter(self) -> RepublishFilter:
        return RepublishFilter(
            batch_id=self.batch_id, statuses=frozenset(map(Status, self.statuses)),
            exchange=self.exchange, created_after=self.created_after,
            created_before=self.created_before, ordering_key=self.ordering_key,
        )  # fmt: skip


class RepublishFilterOut(BaseModel):
    batch_id: str | None
    statuses: list[RepublishStatus]
    exchange: str | None
    created_after: dt.datetime | None
    created_before: dt.datetime | None
    ordering_key: str | None = None


class RepublishOut(BaseModel):
    request_id: str
    dry_run: bool
    replayed: bool = Field(description="The request_id was seen before: its first result, again.")
    count: int = Field(description="Rows moved back to pending (that would move, on a dry run).")
    matched: int = Field(description="Rows matching the filter, before the limit.")
    sample: list[str] = Field(description="Up to 20 message ids among those moved.")
    audit_id: int | None = Field(description="The audit row of a real run.")
    filter: RepublishFilterOut

    @classmethod
    def of(cls, r: RepublishResult, *, request_id: str, flt: RepublishFilter) -> RepublishOut:
        return cls(
            request_id=request_id, dry_run=r.dry_run, replayed=r.replayed, count=r.count,
            matched=r.matched, sample=r.sample, audit_id=r.audit_id,
            filter=RepublishFilterOut.model_validate(flt.as_json()),
        )  # fmt: skip


# ------------------------------------------------------------------------------ health


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Check(BaseModel):
    ok: bool
    detail: str


class Ready(BaseModel):
    ready: bool
    database: Check
    migrations: Check
