"""Each publisher's figures once a minute (``outbox_samples``): its cumulative counters, the
confirm latency of the minute and the outbox's highest id. The console's rates and latency
charts are the differences between consecutive samples: reading them costs the samples of the
window (one per publisher and minute), never the rows, whatever the traffic.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "outbox_samples",
        sa.Column("at", TS, nullable=False),
        sa.Column("publisher_id", sa.Text, nullable=False),
        sa.Column("published", sa.BigInteger, nullable=False),
        sa.Column("confirmed", sa.BigInteger, nullable=False),
        sa.Column("failed", sa.BigInteger, nullable=False),
        sa.Column("lost", sa.BigInteger, nullable=False),
        sa.Column("max_id", sa.BigInteger),
        sa.Column("latency_p50_ms", sa.Float),
        sa.Column("latency_p99_ms", sa.Float),
        sa.PrimaryKeyConstraint("at", "publisher_id", name="pk_outbox_samples"),
    )


def downgrade() -> None:
    op.drop_table("outbox_samples")
