"""Stream destinations (app/streams): a row may name a RabbitMQ stream instead of an exchange
(``outbox.stream``) and carries its publishing id once claimed (``outbox.stream_seq``); a
stream's lanes (``outbox_stream_lanes``) are the broker reference names its rows go out under,
one publisher at a time each. Rows for exchanges are untouched: both new columns are NULL and
stay out of the new partial index.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
STREAM_OPEN = "stream IS NOT NULL AND status IN ('pending', 'in_flight')"


def upgrade() -> None:
    # nullable columns without a default: PostgreSQL adds them without rewriting the table
    op.add_column("outbox", sa.Column("stream", sa.Text))
    op.add_column("outbox", sa.Column("stream_seq", sa.BigInteger))
    op.create_index(
        "ix_outbox_stream_open",
        "outbox",
        ["stream", "id"],
        postgresql_where=sa.text(STREAM_OPEN),
        sqlite_where=sa.text(STREAM_OPEN),
    )
    op.create_table(
        "outbox_stream_lanes",
        sa.Column("stream", sa.Text, nullable=False),
        sa.Column("lane", sa.Integer, nullable=False),
        sa.Column("lanes", sa.Integer, nullable=False),
        sa.Column("reference", sa.Text, nullable=False),
        sa.Column("next_seq", sa.BigInteger, nullable=False, server_default=sa.text("1")),
        sa.Column("owner", sa.Text),
        sa.Column("lease_until", TS),
        sa.Column("taken_at", TS),
        sa.Column("takeovers", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("stream", "lane", name="pk_outbox_stream_lanes"),
        sa.CheckConstraint("lane >= 0 AND lane < lanes", name="ck_outbox_stream_lanes_lane"),
        sa.CheckConstraint("next_seq >= 1", name="ck_outbox_stream_lanes_next_seq"),
    )


def downgrade() -> None:
    op.drop_table("outbox_stream_lanes")
    op.drop_index("ix_outbox_stream_open", table_name="outbox")
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("stream_seq")
        batch.drop_column("stream")
