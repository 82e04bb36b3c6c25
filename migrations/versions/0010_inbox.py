"""The consumer kit's inbox: one row per (consumer, message_id) whose effect is done, written in
the same transaction as the handler's own writes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_inbox",
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("message_id", sa.Text, nullable=False),
        sa.Column(
            "received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint("consumer", "message_id", name="pk_outbox_inbox"),
    )
    op.create_index("ix_outbox_inbox_received", "outbox_inbox", ["received_at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_inbox_received", table_name="outbox_inbox")
    op.drop_table("outbox_inbox")
