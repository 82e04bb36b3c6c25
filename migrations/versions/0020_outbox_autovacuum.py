"""PostgreSQL: autovacuum settings of the outbox's own, for a table that is a queue.

Every row of the outbox leaves three dead versions behind it (the claim's update, the confirm's
update, the purge's delete), so at a steady few thousand rows a second the table produces
dead tuples faster than PostgreSQL's default autovacuum, throttled for tables that change
slowly, reclaims them. The soak measured it: with the defaults the outbox was being vacuumed
for 43 % of a 30-minute run and still grew 1.43 x past what the retention keeps. These
settings are the table's only (``ALTER TABLE ... SET``), never the server's; an operator may
change them the same way (docs/operations.md).

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

#: the outbox's storage parameters (docs/operations.md, "Autovacuum")
SETTINGS = {
    "autovacuum_vacuum_cost_delay": "0",
    "autovacuum_vacuum_scale_factor": "0.05",
}


def _current() -> dict[str, str]:
    """The outbox's storage parameters as set now (an operator's included); none when the
    migration only writes SQL (``alembic upgrade --sql``: no database to ask)."""
    if context.is_offline_mode():
        return {}
    options = (
        op.get_bind()
        .execute(sa.text("SELECT reloptions FROM pg_class WHERE oid = 'outbox'::regclass"))
        .scalar_one()
    )
    return dict(o.split("=", 1) for o in options or [])


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    current = _current()
    # a value an operator set before this migration is theirs: kept
    ours = {k: v for k, v in SETTINGS.items() if k not in current}
    if ours:
        op.execute(f"ALTER TABLE outbox SET ({', '.join(f'{k} = {v}' for k, v in ours.items())})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    current = _current()
    ours = [  # an operator's value stays (offline: every one of ours is reset)
        k for k, v in SETTINGS.items() if current.get(k, v) == v
    ]
    if ours:
        op.execute(f"ALTER TABLE outbox RESET ({', '.join(ours)})")
