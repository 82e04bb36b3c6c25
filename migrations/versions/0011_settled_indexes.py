"""Status counts, failures and possible duplicates without reading the whole outbox: partial
indexes over the few rows that are not pending, in flight or confirmed, and over the rows that
lost a confirm. Neither is touched by a row that flows pending -> in_flight -> confirmed.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SETTLED_ASIDE = "status IN ('returned', 'nacked', 'failed', 'skipped')"
LOST = "lost_confirms > 0"


def upgrade() -> None:
    op.create_index(
        "ix_outbox_aside",
        "outbox",
        ["status", "exchange", "routing_key"],
        postgresql_where=sa.text(SETTLED_ASIDE),
        sqlite_where=sa.text(SETTLED_ASIDE),
    )
    op.create_index(
        "ix_outbox_lost",
        "outbox",
        ["id"],
        postgresql_where=sa.text(LOST),
        sqlite_where=sa.text(LOST),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_lost", table_name="outbox")
    op.drop_index("ix_outbox_aside", table_name="outbox")
