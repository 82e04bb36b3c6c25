"""SQLAlchemy Core tables of the outbox. The migrations in ``migrations/`` create exactly these."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.types import TypeDecorator, UserDefinedType

from app.outbox.states import Status

metadata = MetaData()

#: The outbox's own Alembic version table: it shares a database politely with other
#: Alembic applications (whose ``alembic_version`` it never reads or writes).
VERSION_TABLE = "outbox_alembic_version"
STATUS_VALUES = ", ".join(f"'{s.value}'" for s in Status)
#: Rows that hold their ordering key back (see app.outbox.states.RELEASES_KEY).
KEY_OPEN = "ordering_key IS NOT NULL AND status NOT IN ('confirmed', 'skipped')"
#: Rows set aside: terminal failures and operator skips (few next to confirmed rows).
SETTLED_ASIDE = "status IN ('returned', 'nacked', 'failed', 'skipped')"
#: Pending rows with a delivery time of their own (delayed delivery; few next to the outbox).
DELAYED = "status = 'pending' AND not_before IS NOT NULL"
#: Rows for a stream not settled yet: what its lanes claim and take over.
STREAM_OPEN = "stream IS NOT NULL AND status IN ('pending', 'in_flight')"
#: Rows whose confirm was lost at least once (possible duplicates).
LOST = "lost_confirms > 0"
#: ``BIGINT`` identity on PostgreSQL, ``INTEGER PRIMARY KEY`` (the rowid) on SQLite.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class _PgXid8(UserDefinedType[str]):
    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "xid8"


#: A transaction id (``xid8``) on PostgreSQL, read as its decimal text; ``BIGINT`` on SQLite.
Xid8 = BigInteger().with_variant(_PgXid8(), "postgresql")
#: The row path's own unkeyed pending rows (ix_outbox_row_path_due's predicate).
ROW_PATH_DUE = (
    "status = 'pending' AND ordering_key IS NULL AND stream IS NULL "
    "AND (xid IS NULL OR row_path OR not_before IS NOT NULL)"
)
#: Columns of the settlement's own bookkeeping, never shown as a message's fields.
SETTLEMENT_COLUMNS = frozenset({"xid", "row_path"})
#: Range-shaped rows: the ones a range claim may take (ix_outbox_range's predicate).
RANGE_SHAPE = "xid IS NOT NULL AND ordering_key IS NULL AND stream IS NULL AND not_before IS NULL"


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on both backends (SQLite stores naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        aware: dt.datetime = value.astimezone(dt.UTC)
        return aware.replace(tzinfo=None) if dialect.name == "sqlite" else aware

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # a plain-SQL default such as CURRENT_TIMESTAMP on SQLite
            value = dt.datetime.fromisoformat(value)
        stamp: dt.datetime = value
        return stamp.replace(tzinfo=dt.UTC) if stamp.tzinfo is None else stamp.astimezone(dt.UTC)


def _now() -> Any:
    return func.now()


outbox = Table(
    "outbox",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("message_id", Text, nullable=False),
    Column("batch_id", Text, nullable=False),
    Column("exchange", Text, nullable=False),
    Column("routing_key", Text, nullable=False),
    Column("mandatory", Boolean, nullable=False, server_default=text("true")),
    Column("body", LargeBinary, nullable=False),
    Column("content_type", Text),
    Column("headers", JSON),
    Column("properties", JSON),
    Column("ordering_key", Text),
    Column("status", Text, nullable=False, server_default=Status.PENDING.value),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False, server_default=text("10")),
    Column("lost_confirms", Integer, nullable=False, server_default=text("0")),
    # the broker's nacks of this row: its own budget (max_attempts), apart from lost confirms
    Column("nacks", Integer, nullable=False, server_default=text("0")),
    Column("available_at", UTCDateTime, nullable=False, server_default=_now()),
    # delayed delivery: never published before this time (the writer also sets available_at to
    # it, so the claim's walk of ix_outbox_due never reads a row that is not due yet)
    Column("not_before", UTCDateTime),
    Column("lease_owner", Text),
    Column("lease_until", UTCDateTime),
    # when the current attempt was claimed: a row claimed and not yet published (the broker
    # blocks us, say) still shows its age among the outstanding confirms
    Column("claimed_at", UTCDateTime),
    Column("channel_id", Integer),
    Column("delivery_tag", BigInteger),
    Column("created_at", UTCDateTime, nullable=False, server_default=_now()),
    Column("published_at", UTCDateTime),
    Column("confirmed_at", UTCDateTime),
    Column("last_error", Text),
    Column("reply_code", Integer),
    Column("reply_text", Text),
    # a stream destination (app/streams): the row goes into this RabbitMQ stream, not to an
    # exchange (``exchange`` and ``routing_key`` are then empty), exactly once: ``stream_seq``
    # is its publishing id under its lane's reference name, given when first claimed and kept
    # until confirmed (the broker drops a repeated id); an operator's republish clears it
    Column("stream", Text),
    Column("stream_seq", BigInteger),
    # settlement by ranges (app/outbox/ranges.py): the writing transaction (PostgreSQL only;
    # NULL on rows written before 0023 and on SQLite: the row path owns those), and whether
    # the row path owns this row's status although a range may hold it
    Column("xid", Xid8),
    Column("row_path", Boolean, nullable=False, server_default=text("false")),
    UniqueConstraint("message_id", name="uq_outbox_message_id"),
    CheckConstraint(f"status IN ({STATUS_VALUES})", name="ck_outbox_status"),
    CheckConstraint("attempts >= 0", name="ck_outbox_attempts_nonneg"),
    CheckConstraint("max_attempts >= 1", name="ck_outbox_max_attempts_pos"),
    CheckConstraint("nacks >= 0", name="ck_outbox_nacks_nonneg"),
    CheckConstraint("length(routing_key) <= 255", name="ck_outbox_routing_key_len"),
    CheckConstraint(
        "status <> 'in_flight' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL)",
        name="ck_outbox_in_flight_leased",
    ),
    # Partial indexes only on the rows a publisher looks for: a confirmed row leaves them once,
    # and updates that keep a row outside them stay cheap (HOT on PostgreSQL).
    Index(
        "ix_outbox_due",
        "available_at",
        "id",
        postgresql_where=text("status = 'pending'"),
        sqlite_where=text("status = 'pending'"),
    ),
    # Delayed rows still pending, by delivery time: operators count the rows not due yet apart
    # from late ones without reading the table. A row leaves it when it is claimed.
    Index(
        "ix_outbox_delayed",
        "not_before",
        postgresql_where=text(DELAYED),
        sqlite_where=text(DELAYED),
    ),
    Index(
        "ix_outbox_lease",
        "lease_until",
        postgresql_where=text("status = 'in_flight'"),
        sqlite_where=text("status = 'in_flight'"),
    ),
    # Per-key order: the rows of each ordering key that still hold the key back (not confirmed,
    # not skipped). Its first row per key is the key's head, the only one a claim may take.
    Index(
        "ix_outbox_key_open",
        "ordering_key",
        "id",
        postgresql_where=text(KEY_OPEN),
        sqlite_where=text(KEY_OPEN),
    ),
    # Never updated after the insert: a batch's rows, and its latest write in one probe.
    Index("ix_outbox_batch_written", "batch_id", "created_at"),
    # Rows written in a time range (the overview's rates): BRIN on PostgreSQL, a few pages for
    # millions of rows inserted in time order; never updated, so HOT updates are untouched.
    Index("ix_outbox_created", "created_at", postgresql_using="brin"),
    # Status counts, failures by cause and possible duplicates read these small sets, never the
    # whole table; a row flowing pending -> in_flight -> confirmed touches neither.
    Index(
        "ix_outbox_aside",
        "status",
        "exchange",
        "routing_key",
        postgresql_where=text(SETTLED_ASIDE),
        sqlite_where=text(SETTLED_ASIDE),
    ),
    # A stream's open rows (pending, in flight), for its lanes' claims and takeovers; rows
    # for exchanges never enter it.
    Index(
        "ix_outbox_stream_open",
        "stream",
        "id",
        postgresql_where=text(STREAM_OPEN),
        sqlite_where=text(STREAM_OPEN),
    ),
    Index(
        "ix_outbox_lost",
        "id",
        postgresql_where=text(LOST),
        sqlite_where=text(LOST),
    ),
    # The row path's unkeyed due rows (PostgreSQL), walked by its claim when publishers
    # settle by ranges (a range's members stay pending in ix_outbox_due): migration 0024.
    Index(
        "ix_outbox_row_path_due",
        "available_at",
        "id",
        postgresql_where=text(ROW_PATH_DUE),
    ).ddl_if(dialect="postgresql"),
    # The range-shaped rows in cursor order: what a range claim walks past its cursor.
    Index(
        "ix_outbox_range",
        "xid",
        "id",
        postgresql_where=text(RANGE_SHAPE),
        sqlite_where=text(RANGE_SHAPE),
    ),
)

#: A stream's lanes: each lane is one reference name on the broker, whose publishing ids
#: strictly increase, so one publisher at a time holds it (``owner`` until ``lease_until``).
#: A stream's rows belong to lane ``id % lanes``; ``next_seq`` is the next id to give.
stream_lanes = Table(
    "outbox_stream_lanes",
    metadata,
    Column("stream", Text, nullable=False),
    Column("lane", Integer, nullable=False),
    Column("lanes", Integer, nullable=False),
    # the broker's producer reference: unique to this outbox, so that two outboxes writing
    # into one stream never drop each other's messages as duplicates
    Column("reference", Text, nullable=False),
    Column("next_seq", BigInteger, nullable=False, server_default=text("1")),
    Column("owner", Text),
    Column("lease_until", UTCDateTime),
    # when the current owner took it, and how often it changed hands (the console's view)
    Column("taken_at", UTCDateTime),
    Column("takeovers", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("stream", "lane", name="pk_outbox_stream_lanes"),
    CheckConstraint("lane >= 0 AND lane < lanes", name="ck_outbox_stream_lanes_lane"),
    CheckConstraint("next_seq >= 1", name="ck_outbox_stream_lanes_next_seq"),
)

batches = Table(
    "outbox_batches",
    metadata,
    Column("batch_id", Text, primary_key=True),
    Column("sink", Text, nullable=False),
    Column("spark_batch_id", BigInteger, nullable=False),
    Column("query_id", Text),
    Column("row_count", BigInteger, nullable=False),
    Column("rejected_count", BigInteger, nullable=False, server_default=text("0")),
    Column("committed_at", UTCDateTime, nullable=False, server_default=_now()),
    CheckConstraint("row_count >= 0", name="ck_outbox_batches_row_count_nonneg"),
)

#: Settlement by ranges (app/outbox/ranges.py): each claim's interval of ``(xid, id)`` past the
#: cursor, less the running transactions it passed (``holes``) and the held batches it skipped
#: (``skipped``); or a late claim of one ended hole (``late_xid``) or one lifted batch
#: (``late_batch``). Leased to ``owner`` until ``lease_until``, then settled.
ranges = Table(
    "outbox_ranges",
    metadata,
    Column("range_id", BigId, primary_key=True, autoincrement=True),
    Column("lo_xid", Xid8, nullable=False, server_default=text("'0'")),
    Column("lo_id", BigInteger, nullable=False, server_default=text("0")),
    Column("hi_xid", Xid8, nullable=False, server_default=text("'0'")),
    Column("hi_id", BigInteger, nullable=False, server_default=text("0")),
    Column("late_batch", Text),
    Column("late_xid", Xid8),
    Column("rows", Integer, nullable=False),
    Column("owner", Text),
    Column("lease_until", UTCDateTime),
    Column("claimed_at", UTCDateTime, nullable=False, server_default=_now()),
    Column("settled_at", UTCDateTime),
    Column("attempts", Integer, nullable=False, server_default=text("1")),
    Column("skipped", Text, nullable=False),  # text[] on PostgreSQL
    Column("holes", Text, nullable=False),  # xid8[] on PostgreSQL
    Index(
        "ix_outbox_ranges_leased",
        "lease_until",
        postgresql_where=text("settled_at IS NULL"),
        sqlite_where=text("settled_at IS NULL"),
    ),
    Index("ix_outbox_ranges_settled", "settled_at"),
    *(
        Index(name, *columns.split(", "), postgresql_where=text(w), sqlite_where=text(w))
        for name, columns, w in (
            (
                "ix_outbox_ranges_interval",
                "hi_xid, hi_id",
                "late_batch IS NULL AND late_xid IS NULL",
            ),
            ("ix_outbox_ranges_late_xid", "late_xid", "late_xid IS NOT NULL"),
            ("ix_outbox_ranges_late_batch", "late_batch", "late_batch IS NOT NULL"),
            ("ix_outbox_ranges_holes", "range_id", "holes <> '{}'"),
            ("ix_outbox_ranges_skipped", "range_id", "skipped <> '{}'"),
        )
    ),
)

#: The last ``(xid, id)`` a range claim passed: one row, locked by each claim.
range_cursor = Table(
    "outbox_range_cursor",
    metadata,
    Column("one", Boolean, primary_key=True, server_default=text("true")),
    Column("xid", Xid8, nullable=False),
    Column("id", BigInteger, nullable=False),
)

#: Spark batches whose rows are written but must not be published yet (fail mode: the driver
#: holds the batch before its tasks write, and releases it when it records the batch).
held = Table(
    "outbox_held",
    metadata,
    Column("batch_id", Text, primary_key=True),
    Column("held_at", UTCDateTime, nullable=False, server_default=_now()),
)

rejects = Table(
    "outbox_rejects",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("batch_id", Text, nullable=False),
    Column("sink", Text, nullable=False),
    Column("message_id", Text),
    Column("reason", Text, nullable=False),
    Column("row_json", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False, server_default=_now()),
    Index("ix_outbox_rejects_batch", "batch_id"),
)

audit = Table(
    "outbox_audit",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("at", UTCDateTime, nullable=False, server_default=_now()),
    Column("actor", Text, nullable=False),  # who the client says acts (X-Outbox-Actor, --actor)
    Column("principal", Text),  # who the server verified (the token's name; the CLI's OS user)
    Column("client_addr", Text),  # the peer address (API) or host (CLI)
    Column("action", Text, nullable=False),
    Column("request_id", Text),
    UniqueConstraint("request_id", name="uq_outbox_audit_request_id"),
    Column("filter", JSON, nullable=False),
    Column("count", Integer, nullable=False),
    Column("result", JSON),
    CheckConstraint("count >= 0", name="ck_outbox_audit_count_nonneg"),
)

#: The consumer kit's inbox (app.consumer): a message's effect is done once per consumer.
inbox = Table(
    "outbox_inbox",
    metadata,
    Column("consumer", Text, nullable=False),
    Column("message_id", Text, nullable=False),
    Column("received_at", UTCDateTime, nullable=False, server_default=_now()),
    PrimaryKeyConstraint("consumer", "message_id", name="pk_outbox_inbox"),
    Index("ix_outbox_inbox_received", "received_at"),
)

#: The consumer kit's attempts (app.consumer): how often a message's handler started without
#: an outcome (it raised, timed out, or its process died), recorded before a retry runs it, so a
#: message that kills its consumer is dead-lettered after the limit; deleted with its effect.
consumer_attempts = Table(
    "outbox_consumer_attempts",
    metadata,
    Column("consumer", Text, nullable=False),
    Column("message_id", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text),
    Column("updated_at", UTCDateTime, nullable=False, server_default=_now()),
    PrimaryKeyConstraint("consumer", "message_id", name="pk_outbox_consumer_attempts"),
    CheckConstraint("attempts >= 0", name="ck_outbox_consumer_attempts_count"),
)

publishers = Table(
    "outbox_publishers",
    metadata,
    Column("publisher_id", Text, primary_key=True),
    Column("hostname", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    Column("heartbeat_at", UTCDateTime, nullable=False),
    Column("stopped_at", UTCDateTime),
    Column("stats", JSON),
)

#: Server-side secrets generated once and shared by every API replica (``ui-session``: the key
#: that signs web console sessions when ``OUTBOX_SESSION_SECRET`` is not set).
api_secrets = Table(
    "outbox_secrets",
    metadata,
    Column("name", Text, primary_key=True),
    Column("value", LargeBinary, nullable=False),
    Column("created_at", UTCDateTime, nullable=False, server_default=_now()),
)

#: Web console sessions, by the SHA-256 of the cookie's session id: a signed cookie is honoured
#: only while its row lives and has not ended (sign-out ends it on the server).
ui_sessions = Table(
    "outbox_ui_sessions",
    metadata,
    Column("session_hash", Text, primary_key=True),
    Column("principal", Text, nullable=False),
    Column("created_at", UTCDateTime, nullable=False, server_default=_now()),
    Column("expires_at", UTCDateTime, nullable=False),
    Column("ended_at", UTCDateTime),
    Index("ix_outbox_ui_sessions_expires", "expires_at"),
)

#: The kinds of :data:`events`: the rare facts of a message's life (never a claim, a publish or
#: a confirm: the hot path writes nothing here).
EVENT_KINDS = ("retry", "lost", "returned", "nacked", "failed", "republished", "skipped")

#: Append-only history of the rare events of each message: a failed attempt (retried), a lost
#: confirm, a return, a nack or a failure that ended its attempts, an operator's republish or
#: skip. Written in the transaction of the change it records; never updated.
events = Table(
    "outbox_events",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("outbox_id", BigInteger, nullable=False),
    Column("message_id", Text, nullable=False),
    Column("at", UTCDateTime, nullable=False),
    Column("kind", Text, nullable=False),
    Column("from_status", Text),  # the row's status before an operator's action
    Column("attempt", Integer, nullable=False),
    Column("reply_code", Integer),
    Column("detail", Text),  # the error, the broker's reply, the operator's reason
    Column("actor", Text),
    Column("audit_id", BigInteger),
    CheckConstraint(
        "kind IN ('retry', 'lost', 'returned', 'nacked', 'failed', 'republished', 'skipped')",
        name="ck_outbox_events_kind",
    ),
    Index("ix_outbox_events_row", "outbox_id", "id"),
    Index("ix_outbox_events_at", "at"),
)

#: Each publisher's figures once a minute (migration 0019): cumulative counters (``failed``:
#: returned, nacked and failed rows), the confirm latency of the minute, the outbox's highest id
#: (rows written between two samples are the difference). The console's rates and latency
#: charts read these, never the rows.
samples = Table(
    "outbox_samples",
    metadata,
    Column("at", UTCDateTime, nullable=False),
    Column("publisher_id", Text, nullable=False),
    Column("published", BigInteger, nullable=False),
    Column("confirmed", BigInteger, nullable=False),
    Column("failed", BigInteger, nullable=False),
    Column("lost", BigInteger, nullable=False),
    Column("max_id", BigInteger),
    Column("latency_p50_ms", Float),
    Column("latency_p99_ms", Float),
    PrimaryKeyConstraint("at", "publisher_id", name="pk_outbox_samples"),
)
