"""PostgreSQL: ``NOTIFY outbox_new`` when rows are inserted, so publishers claim them at once
instead of at their next poll. One notification per statement (a COPY of any size is one);
PostgreSQL folds identical notifications of a transaction into one. SQLite: nothing to do.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_notify_new() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('outbox_new', '');
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        "CREATE TRIGGER outbox_notify_new AFTER INSERT ON outbox "
        "FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_new()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS outbox_notify_new ON outbox")
    op.execute("DROP FUNCTION IF EXISTS outbox_notify_new()")
