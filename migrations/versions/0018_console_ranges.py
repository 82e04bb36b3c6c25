"""Indexes for the console's time-ordered reads, none on a column a state change updates (so
PostgreSQL's HOT updates of claims, publishes and confirms are untouched):

- ``ix_outbox_batch_written (batch_id, created_at)`` replaces ``ix_outbox_batch (batch_id)``:
  the same lookups by batch, and a batch's latest write in one probe (batches newest first);
- ``ix_outbox_created`` (BRIN on PostgreSQL, a few pages for millions of rows inserted in time
  order): the rows written in a time range (the overview's rates, searches by time);
- ``ix_outbox_events_at (at)``: the failures of a time range (the overview's rates).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_outbox_batch_written", "outbox", ["batch_id", "created_at"])
    op.drop_index("ix_outbox_batch", table_name="outbox")
    op.create_index("ix_outbox_created", "outbox", ["created_at"], postgresql_using="brin")
    op.create_index("ix_outbox_events_at", "outbox_events", ["at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_events_at", table_name="outbox_events")
    op.drop_index("ix_outbox_created", table_name="outbox")
    op.create_index("ix_outbox_batch", "outbox", ["batch_id"])
    op.drop_index("ix_outbox_batch_written", table_name="outbox")
