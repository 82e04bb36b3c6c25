"""Rows remember when their current attempt was claimed (outstanding confirms show the age of
rows claimed but not yet published).

Revision ID: 0006
Revises: 0002
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outbox") as batch:
        batch.add_column(sa.Column("claimed_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("claimed_at")
