"""The row path's own due rows, for publishers settling by ranges (issue 47).

With ``OUTBOX_SETTLEMENT=ranges`` a range's members stay ``pending`` in their own ``status``
(the point: they are never rewritten), so ``ix_outbox_due`` holds every one of them until
retention; the row path's unkeyed claim walks this index instead: pending rows the row path
owns (written before 0023, ``row_path``, or delayed). A plain row written since 0023 never
enters it. PostgreSQL only: SQLite settles rows, and there every pending row would enter both.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-30
"""

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

#: app/outbox/schema.py ROW_PATH_DUE; the row path's unkeyed claim states it in these words.
ROW_PATH_DUE = (
    "status = 'pending' AND ordering_key IS NULL AND stream IS NULL "
    "AND (xid IS NULL OR row_path OR not_before IS NOT NULL)"
)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"CREATE INDEX ix_outbox_row_path_due ON outbox (available_at, id) WHERE {ROW_PATH_DUE}"
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_outbox_row_path_due")
