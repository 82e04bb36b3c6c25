"""Rows count the broker's nacks apart from their attempts: ``attempts`` counts every claim
(a lost confirm spends one), ``nacks`` only the broker's ``basic.nack``, and a row ends
``nacked`` on ``nacks >= max_attempts``, so a cluster failover's lost confirms never end a row.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outbox") as batch:
        batch.add_column(sa.Column("nacks", sa.Integer, nullable=False, server_default="0"))
        batch.create_check_constraint("ck_outbox_nacks_nonneg", "nacks >= 0")


def downgrade() -> None:
    with op.batch_alter_table("outbox") as batch:
        batch.drop_constraint("ck_outbox_nacks_nonneg", type_="check")
        batch.drop_column("nacks")
