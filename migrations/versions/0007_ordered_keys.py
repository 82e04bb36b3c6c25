"""Per-key order: the ``skipped`` status (an operator releases a parked key) and the partial index
of the rows that hold their ordering key back.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

OLD = "'pending', 'in_flight', 'confirmed', 'returned', 'nacked', 'failed'"
NEW = OLD + ", 'skipped'"
KEY_OPEN = "ordering_key IS NOT NULL AND status NOT IN ('confirmed', 'skipped')"


def _status_check(values: str) -> None:
    with op.batch_alter_table("outbox") as batch:
        batch.drop_constraint("ck_outbox_status", type_="check")
        batch.create_check_constraint("ck_outbox_status", f"status IN ({values})")


def upgrade() -> None:
    _status_check(NEW)
    op.create_index(
        "ix_outbox_key_open",
        "outbox",
        ["ordering_key", "id"],
        postgresql_where=sa.text(KEY_OPEN),
        sqlite_where=sa.text(KEY_OPEN),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_key_open", table_name="outbox")
    op.execute("UPDATE outbox SET status = 'failed' WHERE status = 'skipped'")
    _status_check(OLD)
