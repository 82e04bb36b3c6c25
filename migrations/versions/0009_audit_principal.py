"""Audit rows record who acted as the server verified it (the token's name) and from which
client address, beside the actor the client claims; indexes for the failure views.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_audit") as batch:
        batch.add_column(sa.Column("principal", sa.Text))
        batch.add_column(sa.Column("client_addr", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("outbox_audit") as batch:
        batch.drop_column("client_addr")
        batch.drop_column("principal")
