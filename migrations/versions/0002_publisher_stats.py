"""Publishers report their counters (published, confirmed, lost confirms, ...) with each heartbeat.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_publishers") as batch:
        batch.add_column(sa.Column("stats", sa.JSON))


def downgrade() -> None:
    with op.batch_alter_table("outbox_publishers") as batch:
        batch.drop_column("stats")
