"""Batches on hold: ``outbox_held`` names the Spark batches whose rows must not be published yet.

The Spark writers in fail mode check each row in the same pass that writes it, so a batch's
good partitions commit before the driver knows whether another partition found a bad row. The
driver therefore holds the batch (one row here) before its tasks write; publishers never claim
a row of a held batch; the transaction that records the batch in ``outbox_batches`` deletes the
hold, and a batch that fails is removed instead. One row per batch, never one write per message.
PostgreSQL: deleting a hold notifies ``outbox_new`` (the batch's rows are due at once), and an
insert into a held batch does not (its transaction sets ``outbox.quiet``): a publisher woken
then would only walk past rows it may not take.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


NOTIFY_UNLESS_QUIET = """
CREATE OR REPLACE FUNCTION outbox_notify_new() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('outbox.quiet', true), '') <> 'on' THEN
        PERFORM pg_notify('outbox_new', '');
    END IF;
    RETURN NULL;
END $$
"""
NOTIFY_ALWAYS = """
CREATE OR REPLACE FUNCTION outbox_notify_new() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_new', '');
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    op.create_table(
        "outbox_held",
        sa.Column("batch_id", sa.Text, primary_key=True),
        sa.Column(
            "held_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(NOTIFY_UNLESS_QUIET)
        op.execute(
            "CREATE TRIGGER outbox_notify_released AFTER DELETE ON outbox_held "
            "FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_new()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS outbox_notify_released ON outbox_held")
        op.execute(NOTIFY_ALWAYS)
    op.drop_table("outbox_held")
