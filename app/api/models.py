"""Request and response bodies of the REST API (and of the CLI's ``--json`` output).

Every request field is constrained so that bad input is a 422 naming the field, never a database
error: strings are bounded and free of control characters, numbers are bounded, datetimes carry a
timezone.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_type_hints

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    model_validator,
)

from app.outbox.actions import (
    CONTROL_CHARACTERS,
    MAX_ACTOR,
    OPERATOR_TEXT_FORBIDDEN,
    RepublishResult,
)
from app.outbox.read.batches import BatchSummary
from app.outbox.read.failures import FailureGroup
from app.outbox.read.keys import ParkedKey
from app.outbox.read.messages import MessageRecord
from app.outbox.read.outstanding import OutstandingConfirm, StreamLane
from app.outbox.read.stats import OutboxStats, PublisherInfo
from app.outbox.reports import PublisherReport
from app.outbox.scope import CAUSE_LENGTH, CRITERIA, RepublishFilter, ScopeError
from app.outbox.states import Status
from app.outbox.upkeep import Upkeep, advice
from app.streams.names import check_stream_name

#: No control characters (PostgreSQL text refuses NUL), bounded length.
TEXT_PATTERN = rf"^[^{CONTROL_CHARACTERS}]+$"
#: An operator's text (a skip reason): no controls, C1 included, line separators or bidi controls.
OPERATOR_TEXT_PATTERN = rf"^[^{OPERATOR_TEXT_FORBIDDEN}]+$"
CURSOR_PATTERN = r"^[A-Za-z0-9_-]+$"
#: An actor name or request id: printable ASCII, no leading space.
TOKEN_PATTERN = r"^[!-~][ -~]*$"
MAX_REPUBLISH_LIMIT = 100_000
MAX_AGE_SECONDS = 10 * 365 * 86400


M = TypeVar("M", bound=BaseModel)


def copied(model: type[M], source: object, **given: Any) -> M:
    """``model`` with each field not ``given`` read from the attribute of that name of
    ``source`` (a read record), as the record holds it."""
    values = {name: getattr(source, name) for name in model.model_fields if name not in given}
    return model(**values, **given)


def utf8_text(value: str) -> str:
    value.encode()  # lone surrogates raise here (UnicodeEncodeError is a ValueError)
    return value


utf8 = AfterValidator(utf8_text)
Text = Annotated[str, Field(min_length=1, max_length=1024, pattern=TEXT_PATTERN), utf8]
#: An exchange or routing key as a filter: "" is one (the default exchange; never a stream's).
Place = Annotated[str, Field(max_length=1024, pattern=rf"^[^{CONTROL_CHARACTERS}]*$"), utf8]
Cursor = Annotated[str, Field(min_length=4, max_length=2048, pattern=CURSOR_PATTERN)]
#: A RabbitMQ stream's name as a filter: what a stream may be named (at most 255 bytes, no
#: control characters, not ``amq.``), checked as the rows' writers check it.
StreamName = Annotated[
    str,
    Field(min_length=1, max_length=255, description="A RabbitMQ stream's rows only."),
    AfterValidator(check_stream_name),
]
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


def record_fields(
    record: type[Any], *, leave_out: str, docs: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A response model's fields from a read-side record (a frozen dataclass): every field but
    ``leave_out``, with its type and its description from ``docs`` (one shape for a row: a field
    added to the record is in the answer too)."""
    hints = get_type_hints(record)
    return {
        f.name: (hints[f.name], Field(description=(docs or {}).get(f.name)))
        for f in dataclasses.fields(record)
        if f.name != leave_out
    }


class PublisherOutBase(BaseModel):
    """A publisher as the API answers it: the fields of its row (:class:`PublisherInfo`) but the
    raw ``stats``, and what they say: whether the broker blocks it, its report."""

    @classmethod
    def of(cls, p: PublisherInfo) -> PublisherOutBase:
        return cls(**{name: getattr(p, name) for name in cls.model_fields})


if TYPE_CHECKING:
    PublisherOut = PublisherOutBase
else:
    PublisherOut = create_model(
        "PublisherOut",
        __base__=PublisherOutBase,
        **record_fields(PublisherInfo, leave_out="stats"),
        blocked=(
            bool,
            Field(description="The broker blocks this live publisher (resource alarm)."),
        ),
        report=(
            PublisherReport | None,
            Field(description="The publisher's own figures at its last heartbeat."),
        ),
    )


class TableUpkeepOut(BaseModel):
    """The outbox table's upkeep (PostgreSQL): docs/operations.md, "Autovacuum"."""

    live_rows: int = Field(description="Live rows, PostgreSQL's statistics' estimate.")
    dead_rows: int = Field(
        description="Dead row versions not yet vacuumed (each row leaves three behind)."
    )
    table_bytes: int
    index_bytes: int
    last_vacuum_at: dt.datetime | None = Field(
        description="The latest VACUUM of the outbox, by autovacuum or by hand."
    )
    last_analyze_at: dt.datetime | None
    autovacuum_runs: int = Field(description="Autovacuums of the outbox since stats began.")
    vacuum_running: bool = Field(
        description="A VACUUM of the outbox runs now. Autovacuum's workers are seen only by "
        "a role with pg_read_all_stats; otherwise false while they run."
    )
    server_autovacuum: bool = Field(description="The server's autovacuum setting.")
    naptime_seconds: float = Field(description="The server's autovacuum_naptime.")
    table_settings: dict[str, str] = Field(
        description="The outbox's own autovacuum storage parameters (migration 0020 sets "
        "autovacuum_vacuum_cost_delay and autovacuum_vacuum_scale_factor)."
    )
    warnings: list[str] = Field(
        description="Wrong now (outbox status --check warns): autovacuum off, or behind."
    )
    notes: list[str] = Field(
        description="Settings that let dead rows pile up under load; shown, not alarmed on."
    )

    @classmethod
    def of(cls, u: Upkeep, *, now: dt.datetime) -> TableUpkeepOut:
        said = advice(u, now=now)
        return copied(cls, u, warnings=said.warnings, notes=said.notes)


class StatsOut(BaseModel):
    at: dt.datetime
    counts: StatusCounts
    total: int
    confirmed_estimated: bool = Field(
        description="counts.confirmed (and total) is PostgreSQL's estimate: an outbox over "
        "200,000 rows is not counted row by row; every other count is exact."
    )
    oldest_pending_age_seconds: float | None = Field(
        description="Seconds since the oldest pending row was due: written, or its not_before "
        "when later. Delayed rows (not due yet) are not counted here."
    )
    oldest_in_flight_age_seconds: float | None = Field(
        description="Seconds since the oldest unconfirmed publish was sent."
    )
    confirm_latency: ConfirmLatency
    possible_duplicates: int = Field(
        description="Publishes repeated after an unknown outcome (lost confirms), over the rows "
        "for exchanges. A stream's rows are not counted: they are exactly once (a resend goes "
        "out under the same publishing id, which the broker drops)."
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
    delayed: int = Field(
        default=0,
        description="Pending rows whose delivery time (not_before) is still ahead: delayed "
        "delivery, not late. Counted in counts.pending.",
    )
    next_delayed_at: dt.datetime | None = Field(
        default=None, description="The earliest delivery time of the delayed rows."
    )
    publishers_alive: int
    broker_blocked: bool = Field(
        description="A live publisher reports the broker blocking it (memory or disk alarm)."
    )
    publishers: list[PublisherOut]
    table: TableUpkeepOut | None = Field(
        default=None,
        description="The outbox table's size, dead rows and autovacuum (PostgreSQL; null on "
        "SQLite).",
    )

    @classmethod
    def of(cls, s: OutboxStats) -> StatsOut:
        return cls(
            at=s.at,
            counts=StatusCounts.of(s.counts),
            total=sum(s.counts.values()),
            confirmed_estimated=s.confirmed_estimated,
            oldest_pending_age_seconds=s.oldest_pending_age_seconds,
            oldest_in_flight_age_seconds=s.oldest_in_flight_age_seconds,
            confirm_latency=copied(ConfirmLatency, s.confirm_latency),
            possible_duplicates=s.possible_duplicates,
            operator_republished=s.operator_republished,
            publishers_alive=s.publishers_alive,
            parked=s.parked,
            oldest_parked_age_seconds=s.oldest_parked_age_seconds,
            delayed=s.delayed,
            next_delayed_at=s.next_delayed_at,
            broker_blocked=bool(s.blocked_publishers),
            publishers=[PublisherOut.of(p) for p in s.publishers],
            table=TableUpkeepOut.of(s.upkeep, now=s.at) if s.upkeep is not None else None,
        )


# ---------------------------------------------------------------- outstanding confirms


class OutstandingOut(BaseModel):
    id: int
    message_id: str
    batch_id: str
    publisher: str = Field(
        description="The publisher holding the row's lease (a stream's row: its lane's "
        "holder, '<publisher id>#stream')."
    )
    channel_id: int | None = Field(description="None until sent; None for a stream's row.")
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
    lost_confirms: int = Field(
        description="Exchange row: possible duplicates. Stream row: resends under the same "
        "publishing id, which the broker drops (exactly once)."
    )
    stream: str | None = Field(default=None, description="A stream's row: its stream.")
    lane: int | None = Field(
        default=None, description="A stream's row: its lane (GET /v1/streams), id % lanes."
    )
    stream_seq: int | None = Field(
        default=None,
        description="A stream's row: its publishing id in its lane, kept until confirmed.",
    )

    @classmethod
    def of(cls, o: OutstandingConfirm) -> OutstandingOut:
        return cls(**{name: getattr(o, name) for name in cls.model_fields})


class OutstandingPage(BaseModel):
    items: list[OutstandingOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null at end.")


class StreamLaneOut(BaseModel):
    """A stream's lane: one producer reference on the broker, one publisher at a time."""

    stream: str
    lane: int
    lanes: int = Field(description="The stream's lanes; a row's lane is its id % lanes.")
    reference: str = Field(description="The broker's producer reference of the lane.")
    next_seq: int = Field(description="The next publishing id the lane gives.")
    owner: str | None = Field(description="The publisher holding it ('<id>#stream'), if any.")
    lease_until: dt.datetime | None
    held: bool = Field(description="Owned and its lease not run out.")
    taken_at: dt.datetime | None = Field(description="When the current owner took it.")
    takeovers: int = Field(description="Times it was taken from another publisher.")
    in_flight: int = Field(description="Its rows in flight now (ids given, not confirmed).")

    @classmethod
    def of(cls, lane: StreamLane) -> StreamLaneOut:
        return copied(cls, lane)


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
    last_created_at: dt.datetime | None
    written_at: dt.datetime | None = Field(
        description="The batch's latest write (its newest row or its record): the list's order."
    )
    first_published_at: dt.datetime | None
    last_published_at: dt.datetime | None
    first_confirmed_at: dt.datetime | None
    last_confirmed_at: dt.datetime | None
    republished: int = Field(
        description="Publishes repeated after an unknown outcome (possible duplicates), over "
        "its rows for exchanges (a stream's rows are exactly once)."
    )

    @classmethod
    def of(cls, b: BatchSummary) -> BatchOut:
        values: dict[str, Any] = {n: getattr(b, n) for n in cls.model_fields if n != "counts"}
        return cls(**values, counts=StatusCounts.of(b.counts))


class BatchPage(BaseModel):
    items: list[BatchOut] = Field(description="Newest first (by written_at, ties by batch_id).")
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next (older) page; null at the oldest batch."
    )
    prev_cursor: str | None = Field(
        description="Pass as `cursor` for the previous (newer) page; null at the newest."
    )


# ---------------------------------------------------------------------------- messages


class MessageOutBase(BaseModel):
    """A message row as the API answers it: the row's fields (:func:`_message_fields`) and the
    body, base64-encoded (``body_base64``)."""

    @classmethod
    def of(cls, m: MessageRecord) -> MessageOutBase:
        values: dict[str, Any] = {n: getattr(m, n) for n in cls.model_fields if n != "body_base64"}
        values["body_base64"] = base64.b64encode(m.body).decode() if m.body is not None else None
        return cls(**values)


#: Descriptions of the row's fields where the name alone does not say enough.
MESSAGE_FIELD_DOCS = {
    "not_before": "Delayed delivery: not published before this time.",
    "nacks": "Broker nacks of this row (its nack budget: max_attempts).",
    "lost_confirms": "Publishes whose confirm never came: possible duplicates for an "
    "exchange's row. For a stream's row, resends under the same publishing id, which the broker "
    "drops: not duplicates (see delivery).",
    "stream": "A RabbitMQ stream's row: its stream (exchange and routing key are then empty).",
    "stream_seq": "A stream's row: its publishing id in its lane, given at its first claim.",
    "body_size": "The body's length in bytes.",
    "last_error": "Why the row failed; a reason over 8,192 characters is cut and says so.",
    "reply_text": "The broker's reply; over 8,192 characters it is cut and says so.",
}


def _message_fields() -> dict[str, Any]:
    """The answer's fields: every field of :class:`MessageRecord` but the raw body, with
    its type (one shape for a message row: a column added there is in the answer too)."""
    return record_fields(MessageRecord, leave_out="body", docs=MESSAGE_FIELD_DOCS) | {
        "destination": (
            str,
            Field(
                description="Where it goes, in words: its exchange and routing key, or its "
                "stream and publishing id."
            ),
        ),
        "delivery": (
            Literal["at least once", "exactly once"],
            Field(
                description="Exactly once for a stream's row (the broker drops a repeated "
                "publishing id); at least once for an exchange's (see lost_confirms)."
            ),
        ),
        "body_base64": (
            str | None,
            Field(
                description="The body, only with `include_body=true`: its first MiB when "
                "`body_size` is larger."
            ),
        ),
    }


if TYPE_CHECKING:
    MessageOut = MessageOutBase
else:
    MessageOut = create_model("MessageOut", __base__=MessageOutBase, **_message_fields())


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
        return RepublishFilter.of(batch_id=batch_id, statuses=self.statuses)


#: A failure group's cause: its reason's first characters exactly ("" for no reason).
Cause = Annotated[str, Field(max_length=CAUSE_LENGTH, pattern=r"^[^\x00]*$")]


class RepublishRequest(_RepublishBase):
    """Republish terminal failures matching a filter (all given conditions hold). The rules
    (what a filter must say, a range in order) are the filter's own: :class:`RepublishFilter`."""

    message_id: Text | None = Field(default=None, description="One message.")
    batch_id: Text | None = None
    exchange: Place | None = Field(default=None, description='"" is the default exchange.')
    routing_key: Place | None = None
    stream: StreamName | None = None
    ordering_key: Text | None = Field(
        default=None,
        description="The rows of one ordering key: republish a parked key's "
        "blocking row, the key resumes behind it.",
    )
    reason: Text | None = Field(
        default=None,
        description="Substring of the error or reply text, any case (as in GET /v1/messages).",
    )
    cause: Cause | None = Field(
        default=None,
        description="Exactly a failure group's reason (GET /v1/failures): the "
        f"first {CAUSE_LENGTH} characters of the error, else the reply text.",
    )
    created_after: UtcDatetime | None = Field(default=None, description="Inclusive.")
    created_before: UtcDatetime | None = Field(default=None, description="Exclusive.")
    all_failures: bool = Field(
        default=False,
        alias="all",
        description="Set to true to republish every terminal "
        "failure: a request without any filter is refused, so that an empty body never moves "
        "everything.",
    )

    @model_validator(mode="after")
    def _scope(self) -> RepublishRequest:
        try:
            self.to_filter()
        except ScopeError as exc:
            raise ValueError(str(exc)) from None
        return self

    def to_filter(self) -> RepublishFilter:
        given = "statuses" in self.model_fields_set
        return RepublishFilter.of(
            statuses=self.statuses if given else None,
            everything=self.all_failures,
            **{name: getattr(self, name) for name in CRITERIA},
        )


class RepublishFilterOut(BaseModel):
    batch_id: str | None
    statuses: list[RepublishStatus]
    exchange: str | None
    created_after: dt.datetime | None
    created_before: dt.datetime | None
    message_id: str | None = None
    routing_key: str | None = None
    stream: str | None = None
    ordering_key: str | None = None
    reason: str | None = None
    cause: str | None = None


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
        shown = RepublishFilterOut.model_validate(flt.as_json())
        return copied(cls, r, request_id=request_id, filter=shown)


# ------------------------------------------------------------------------------ health


class FailureGroupOut(BaseModel):
    status: str
    exchange: str
    routing_key: str
    reason: str = Field(
        description="The cause (the reason's first 500 characters): pass it as "
        "`cause` to POST /v1/republish to move exactly this group."
    )
    rows: int
    first_created: dt.datetime | None
    last_created: dt.datetime | None
    sample_message_id: str = Field(description="One message of the group (GET /v1/messages/{id}).")
    stream: str | None = Field(
        default=None,
        description="A stream's failures: its stream (exchange and routing key empty); pass "
        "it as `stream` to POST /v1/republish.",
    )

    @classmethod
    def of(cls, g: FailureGroup) -> FailureGroupOut:
        return copied(cls, g, status=g.status.value)


class FailuresOut(BaseModel):
    groups: list[FailureGroupOut]
    rows: int = Field(description="Terminal failures in the groups shown.")

    @classmethod
    def of(cls, groups: Sequence[FailureGroup]) -> FailuresOut:
        return cls(groups=[FailureGroupOut.of(g) for g in groups], rows=sum(g.rows for g in groups))


class ParkedKeyOut(BaseModel):
    ordering_key: str
    blocking_message_id: str = Field(description="The terminal failure the key waits behind.")
    blocking_status: str
    blocking_error: str | None
    blocking_reply_code: int | None
    parked_since: dt.datetime | None
    waiting: int = Field(description="Later rows of the key, not yet published.")

    @classmethod
    def of(cls, k: ParkedKey) -> ParkedKeyOut:
        return copied(cls, k, blocking_status=k.blocking_status.value)


class ParkedKeyPage(BaseModel):
    items: list[ParkedKeyOut]
    next_after: str | None = Field(description="Pass as `after` for the next page.")


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Check(BaseModel):
    ok: bool
    detail: str


class Ready(BaseModel):
    ready: bool
    database: Check
    migrations: Check
