"""Console sessions held on the server: ``outbox_secrets`` keeps the key that signs web console
sessions (generated once when ``OUTBOX_SESSION_SECRET`` is not set, shared by every API replica
of the database), ``outbox_ui_sessions`` the live sessions, so that signing out ends a session
for every copy of its cookie.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_secrets",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("value", sa.LargeBinary, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_table(
        "outbox_ui_sessions",
        sa.Column("session_hash", sa.Text, primary_key=True),
        sa.Column("principal", sa.Text, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_outbox_ui_sessions_expires", "outbox_ui_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_ui_sessions_expires", table_name="outbox_ui_sessions")
    op.drop_table("outbox_ui_sessions")
    op.drop_table("outbox_secrets")
