"""The append-only history of each message's rare events (``outbox_events``): a failed
attempt that is retried, a lost confirm, a return, a nack or failure that ends the attempts,
an operator's republish or skip. Claims, publishes and confirms write nothing here.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "outbox_events",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("outbox_id", sa.BigInteger, nullable=False),
        sa.Column("message_id", sa.Text, nullable=False),
        sa.Column("at", TS, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("from_status", sa.Text),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("reply_code", sa.Integer),
        sa.Column("detail", sa.Text),
        sa.Column("actor", sa.Text),
        sa.Column("audit_id", sa.BigInteger),
        sa.CheckConstraint(
            "kind IN ('retry', 'lost', 'returned', 'nacked', 'failed', 'republished', 'skipped')",
            name="ck_outbox_events_kind",
        ),
    )
    op.create_index("ix_outbox_events_row", "outbox_events", ["outbox_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_outbox_events_row", table_name="outbox_events")
    op.drop_table("outbox_events")
