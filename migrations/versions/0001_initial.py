"""The outbox, its Spark batches, rejected rows, operator audit and publisher registry.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

STATUSES = "'pending', 'in_flight', 'confirmed', 'returned', 'nacked', 'failed'"
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)
NOW = sa.text("CURRENT_TIMESTAMP")


def upgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.Text, nullable=False),
        sa.Column("batch_id", sa.Text, nullable=False),
        sa.Column("exchange", sa.Text, nullable=False),
        sa.Column("routing_key", sa.Text, nullable=False),
        sa.Column("mandatory", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("content_type", sa.Text),
        sa.Column("headers", sa.JSON),
        sa.Column("properties", sa.JSON),
        sa.Column("ordering_key", sa.Text),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default="10"),
        sa.Column("lost_confirms", sa.Integer, nullable=False, server_default="0"),
        sa.Column("available_at", TS, nullable=False, server_default=NOW),
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_until", TS),
        sa.Column("channel_id", sa.Integer),
        sa.Column("delivery_tag", sa.BigInteger),
        sa.Column("created_at", TS, nullable=False, server_default=NOW),
        sa.Column("published_at", TS),
        sa.Column("confirmed_at", TS),
        sa.Column("last_error", sa.Text),
        sa.Column("reply_code", sa.Integer),
        sa.Column("reply_text", sa.Text),
        sa.UniqueConstraint("message_id", name="uq_outbox_message_id"),
        sa.CheckConstraint(f"status IN ({STATUSES})", name="ck_outbox_status"),
        sa.CheckConstraint("attempts >= 0", name="ck_outbox_attempts_nonneg"),
        sa.CheckConstraint("max_attempts >= 1", name="ck_outbox_max_attempts_pos"),
        sa.CheckConstraint("length(routing_key) <= 255", name="ck_outbox_routing_key_len"),
        sa.CheckConstraint(
            "status <> 'in_flight' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL)",
            name="ck_outbox_in_flight_leased",
        ),
    )
    op.create_index(
        "ix_outbox_due",
        "outbox",
        ["available_at", "id"],
        postgresql_where=sa.text("status = 'pending'"),
        sqlite_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "ix_outbox_lease",
        "outbox",
        ["lease_until"],
        postgresql_where=sa.text("status = 'in_flight'"),
        sqlite_where=sa.text("status = 'in_flight'"),
    )
    op.create_index("ix_outbox_batch", "outbox", ["batch_id"])

    op.create_table(
        "outbox_batches",
        sa.Column("batch_id", sa.Text, primary_key=True),
        sa.Column("sink", sa.Text, nullable=False),
        sa.Column("spark_batch_id", sa.BigInteger, nullable=False),
        sa.Column("query_id", sa.Text),
        sa.Column("row_count", sa.BigInteger, nullable=False),
        sa.Column("rejected_count", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("committed_at", TS, nullable=False, server_default=NOW),
        sa.CheckConstraint("row_count >= 0", name="ck_outbox_batches_row_count_nonneg"),
    )
    op.create_table(
        "outbox_rejects",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("batch_id", sa.Text, nullable=False),
        sa.Column("sink", sa.Text, nullable=False),
        sa.Column("message_id", sa.Text),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("row_json", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=NOW),
    )
    op.create_index("ix_outbox_rejects_batch", "outbox_rejects", ["batch_id"])
    op.create_table(
        "outbox_audit",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("at", TS, nullable=False, server_default=NOW),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("request_id", sa.Text),
        sa.Column("filter", sa.JSON, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("result", sa.JSON),
        sa.UniqueConstraint("request_id", name="uq_outbox_audit_request_id"),
        sa.CheckConstraint("count >= 0", name="ck_outbox_audit_count_nonneg"),
    )
    op.create_table(
        "outbox_publishers",
        sa.Column("publisher_id", sa.Text, primary_key=True),
        sa.Column("hostname", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS, nullable=False),
        sa.Column("stopped_at", TS),
    )


def downgrade() -> None:
    op.drop_table("outbox_publishers")
    op.drop_table("outbox_audit")
    op.drop_index("ix_outbox_rejects_batch", table_name="outbox_rejects")
    op.drop_table("outbox_rejects")
    op.drop_table("outbox_batches")
    op.drop_index("ix_outbox_batch", table_name="outbox")
    op.drop_index("ix_outbox_lease", table_name="outbox")
    op.drop_index("ix_outbox_due", table_name="outbox")
    op.drop_table("outbox")
