"""A row for a stream has no ordering key: an ``INSERT`` (or an ``UPDATE`` of either column)
giving both is refused with a clear error, as the message model and the Spark writers already
refuse it. A plain-SQL producer's row with both was claimed by whichever came first: the stream
relay (the key ignored) or the keyed claim of the exchange publishers, which published it to the
default exchange with an empty routing key (returned, its key parked).

A trigger, not a CHECK constraint: a CHECK would have to be validated against every existing
row (and on SQLite the table rebuilt), and an existing row breaking it could then no longer be
claimed or settled. The trigger's ``WHEN`` is evaluated without calling its function, so a
valid row costs nothing measurable. Rows written before this migration with both are left as
they are (``outbox messages --stream`` finds them; an operator clears the key or skips them).

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29
"""

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

REASON = "a stream row has no ordering key (ordering_key is for exchanges)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"""
            CREATE OR REPLACE FUNCTION outbox_stream_unkeyed() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'outbox: {REASON}; message_id %', NEW.message_id
                    USING ERRCODE = 'check_violation';
            END $$
            """
        )
        for event in ("INSERT", "UPDATE OF stream, ordering_key"):
            name = "outbox_stream_unkeyed_" + event.split()[0].lower()
            op.execute(
                f"CREATE TRIGGER {name} BEFORE {event} ON outbox FOR EACH ROW "
                f"WHEN (NEW.stream IS NOT NULL AND NEW.ordering_key IS NOT NULL) "
                "EXECUTE FUNCTION outbox_stream_unkeyed()"
            )
        return
    for event in ("INSERT", "UPDATE OF stream, ordering_key"):
        name = "outbox_stream_unkeyed_" + event.split()[0].lower()
        op.execute(
            f"CREATE TRIGGER {name} BEFORE {event} ON outbox "
            f"WHEN NEW.stream IS NOT NULL AND NEW.ordering_key IS NOT NULL "
            f"BEGIN SELECT RAISE(ABORT, 'outbox: {REASON}'); END"
        )


def downgrade() -> None:
    for name in ("outbox_stream_unkeyed_insert", "outbox_stream_unkeyed_update"):
        if op.get_bind().dialect.name == "postgresql":
            op.execute(f"DROP TRIGGER IF EXISTS {name} ON outbox")
        else:
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS outbox_stream_unkeyed()")
