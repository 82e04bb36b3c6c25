"""Delayed delivery: ``outbox.not_before``, the time before which a message must not be published.

The claim needs nothing new: a delayed row is written with ``available_at`` = its ``not_before``,
so it sits at the far end of ``ix_outbox_due`` (ordered by ``available_at``) and the claim's walk,
which stops at the first row not yet due, never reads it. ``not_before`` itself is what operators
see: ``ix_outbox_delayed`` holds only pending rows that carry one, so counting the rows still
delayed reads that small index, never the table. A row leaves it when it is claimed.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

DELAYED = "status = 'pending' AND not_before IS NOT NULL"


def upgrade() -> None:
    op.add_column("outbox", sa.Column("not_before", sa.DateTime(timezone=True)))
    op.create_index(
        "ix_outbox_delayed",
        "outbox",
        ["not_before"],
        postgresql_where=sa.text(DELAYED),
        sqlite_where=sa.text(DELAYED),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_delayed", table_name="outbox")
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("not_before")
