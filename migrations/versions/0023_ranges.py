"""Settlement by ranges (issue 47, docs/architecture.md "Settlement by ranges"): the columns and
tables a range claim needs, on both backends; PostgreSQL alone writes ``xid``.

- ``outbox.xid``: the writing transaction (``pg_current_xact_id()``), so a claim can keep commit
  order. Added without a default and then given one, so every existing row keeps NULL (the row
  path owns it, as today) and the table is not rewritten. SQLite has one writer: no ``xid``, and
  its rows all stay on the row path.
- ``outbox.row_path``: the row path owns this row's status (an exception after a claim, a row a
  claim handed over). Only ever goes from false to true.
- ``outbox_ranges``: one row per claim, its interval of ``(xid, id)`` (less the running
  transactions it passed, ``holes``, and the held batches it skipped, ``skipped``), or a late
  claim of one ended hole (``late_xid``) or one lifted batch (``late_batch``); leased, then
  settled.
- ``outbox_range_cursor``: the last ``(xid, id)`` a claim passed. One row, locked by each claim.
- ``ix_outbox_range``: the range-shaped rows in cursor order (``xid`` set, no ordering key, no
  stream, no delivery time).
- A trigger refusing an UPDATE of the shape columns on a row with an ``xid``: a range's members
  must never change after its claim. Named after 0022's, so that a stream row given a key gets
  0022's more precise reason first (PostgreSQL fires a table's triggers by name).

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

SHAPE = "xid IS NOT NULL AND ordering_key IS NULL AND stream IS NULL AND not_before IS NULL"
#: The few ranges each lookup reads: the interval holding a row (read views), the late ranges,
#: and the ranges with holes or skipped batches (each claim looks at those).
RANGE_INDEXES = [
    ("ix_outbox_ranges_interval", "hi_xid, hi_id", "late_batch IS NULL AND late_xid IS NULL"),
    ("ix_outbox_ranges_late_xid", "late_xid", "late_xid IS NOT NULL"),
    ("ix_outbox_ranges_late_batch", "late_batch", "late_batch IS NOT NULL"),
    ("ix_outbox_ranges_holes", "range_id", "holes <> '{}'"),
    ("ix_outbox_ranges_skipped", "range_id", "skipped <> '{}'"),
]
REASON = "ordering_key, stream and not_before are fixed once a row is written"


def upgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    if pg:
        op.execute("ALTER TABLE outbox ADD COLUMN xid xid8")
        op.execute("ALTER TABLE outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id()")
    else:
        op.add_column("outbox", sa.Column("xid", sa.BigInteger()))
    op.add_column(
        "outbox", sa.Column("row_path", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    xid_type = "xid8" if pg else "bigint"
    array = "xid8[]" if pg else "text"
    texts = "text[]" if pg else "text"
    empty = "'{}'"
    big_id = "bigserial PRIMARY KEY" if pg else "INTEGER PRIMARY KEY"
    stamp = "timestamptz" if pg else "datetime"
    op.execute(
        f"""
        CREATE TABLE outbox_ranges (
            range_id {big_id},
            lo_xid {xid_type} NOT NULL DEFAULT '0',
            lo_id bigint NOT NULL DEFAULT 0,
            hi_xid {xid_type} NOT NULL DEFAULT '0',
            hi_id bigint NOT NULL DEFAULT 0,
            late_batch text,
            late_xid {xid_type},
            rows integer NOT NULL,
            owner text,
            lease_until {stamp},
            claimed_at {stamp} NOT NULL DEFAULT CURRENT_TIMESTAMP,
            settled_at {stamp},
            attempts integer NOT NULL DEFAULT 1,
            skipped {texts} NOT NULL DEFAULT {empty},
            holes {array} NOT NULL DEFAULT {empty}
        )
        """
    )
    op.execute(
        "CREATE INDEX ix_outbox_ranges_leased ON outbox_ranges (lease_until) "
        "WHERE settled_at IS NULL"
    )
    op.execute("CREATE INDEX ix_outbox_ranges_settled ON outbox_ranges (settled_at)")
    for name, columns, where in RANGE_INDEXES:
        op.execute(f"CREATE INDEX {name} ON outbox_ranges ({columns}) WHERE {where}")
    op.execute(
        f"""
        CREATE TABLE outbox_range_cursor (
            one boolean PRIMARY KEY DEFAULT true CHECK (one),
            xid {xid_type} NOT NULL,
            id bigint NOT NULL
        )
        """
    )
    op.execute("INSERT INTO outbox_range_cursor (one, xid, id) VALUES (true, '0', 0)")
    op.execute(f"CREATE INDEX ix_outbox_range ON outbox (xid, id) WHERE {SHAPE}")
    if pg:
        op.execute(
            f"""
            CREATE OR REPLACE FUNCTION outbox_xid_shape_fixed() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'outbox: {REASON}; message_id %', NEW.message_id
                    USING ERRCODE = 'check_violation';
            END $$
            """
        )
        op.execute(
            "CREATE TRIGGER outbox_xid_shape_fixed BEFORE UPDATE OF ordering_key, stream, "
            "not_before ON outbox FOR EACH ROW WHEN (OLD.xid IS NOT NULL AND ("
            "NEW.ordering_key IS DISTINCT FROM OLD.ordering_key OR "
            "NEW.stream IS DISTINCT FROM OLD.stream OR "
            "NEW.not_before IS DISTINCT FROM OLD.not_before)) "
            "EXECUTE FUNCTION outbox_xid_shape_fixed()"
        )


#: The members of every range not settled by the row path (app/outbox/ranges.py MEMBERS, frozen
#: here as of this revision): ``(range_id, row id)``.
UNPARKED = "o.available_at <> '9999-12-31 00:00:00+00'"
DOMAIN = (
    "((r.late_batch IS NULL AND r.late_xid IS NULL AND (o.xid, o.id) > (r.lo_xid, r.lo_id) "
    "AND (o.xid, o.id) <= (r.hi_xid, r.hi_id) AND NOT (o.xid = ANY(r.holes))) "
    "OR (r.late_xid IS NOT NULL AND o.xid = r.late_xid))"
)
ROW_SHAPE = (
    "o.xid IS NOT NULL AND o.ordering_key IS NULL AND o.stream IS NULL AND o.not_before IS NULL"
)
MEMBERS = f"""
SELECT r.range_id, o.id FROM outbox_ranges r JOIN outbox o ON {DOMAIN}
WHERE {ROW_SHAPE} AND {UNPARKED} AND NOT (o.batch_id = ANY(r.skipped))
UNION ALL
SELECT l.range_id, o.id FROM outbox_ranges l
  JOIN outbox_ranges r ON l.late_batch = ANY(r.skipped) AND r.range_id BETWEEN l.lo_id AND l.hi_id
  JOIN outbox o ON o.batch_id = l.late_batch AND {DOMAIN}
WHERE {ROW_SHAPE} AND {UNPARKED}
"""
#: Before the ranges go, each member the row path does not own gets its derived status written
#: on the row: ``confirmed`` (a settled range's), or ``pending`` again as a possible duplicate
#: (a leased range's: its publisher's confirms are lost with the range).
MATERIALISE = f"""
WITH m AS ({MEMBERS})
UPDATE outbox o SET
  status = CASE WHEN r.settled_at IS NOT NULL THEN 'confirmed' ELSE 'pending' END,
  confirmed_at = CASE WHEN r.settled_at IS NOT NULL THEN r.settled_at END,
  published_at = CASE WHEN r.settled_at IS NOT NULL THEN r.claimed_at END,
  lost_confirms = o.lost_confirms + CASE WHEN r.settled_at IS NULL THEN 1 ELSE 0 END,
  available_at = CASE WHEN r.settled_at IS NULL THEN now() ELSE o.available_at END
FROM m JOIN outbox_ranges r ON r.range_id = m.range_id
WHERE o.id = m.id AND NOT o.row_path AND o.status = 'pending'
"""


def downgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    if pg:
        op.execute(MATERIALISE)
        op.execute("DROP TRIGGER IF EXISTS outbox_xid_shape_fixed ON outbox")
        op.execute("DROP FUNCTION IF EXISTS outbox_xid_shape_fixed()")
    op.execute("DROP INDEX IF EXISTS ix_outbox_range")
    op.execute("DROP TABLE IF EXISTS outbox_range_cursor")
    op.execute("DROP TABLE IF EXISTS outbox_ranges")
    op.execute("ALTER TABLE outbox DROP COLUMN row_path")
    op.execute("ALTER TABLE outbox DROP COLUMN xid")
