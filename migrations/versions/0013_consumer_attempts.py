"""The consumer kit's attempts: one row per message whose handler started without an outcome.

A row is written before a redelivered message's handler runs (and when a handler raises), so a
message that kills the consumer's process is counted although nothing ran after it; the row goes
in the transaction of the message's effect, or when it is dead-lettered. Few rows: only failing
or redelivered messages ever have one.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_consumer_attempts",
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("message_id", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint("consumer", "message_id", name="pk_outbox_consumer_attempts"),
        sa.CheckConstraint("attempts >= 0", name="ck_outbox_consumer_attempts_count"),
    )


def downgrade() -> None:
    op.drop_table("outbox_consumer_attempts")
