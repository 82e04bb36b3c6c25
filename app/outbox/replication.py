"""How far the streaming standbys have the WAL, in one SQL expression that the publisher (its
write-backs) and the Spark writer (its batches) both read. Pure: no SQLAlchemy, so the Spark
writer's executors read it without the ORM.

A commit the primary acknowledged may be missing on a standby: always with asynchronous
replication, and with synchronous replication for a transaction that did not wait for it
(``synchronous_commit = off``, the publisher's write-backs). A failover to that standby undoes
it. So a writer that must know its commit survives a failover compares the WAL position past
its commit with this expression's.
"""

from __future__ import annotations

#: The lowest WAL position, in bytes, that every streaming standby has on its disk: NULL when
#: none streams, -1 when this role may not read a standby's position (it lacks
#: pg_read_all_stats: the row shows, its positions are NULL). The senders of logical
#: replication (a CDC reader) are not standbys and never hold anything back.
STANDBYS_FLUSHED = (
    "(SELECT CASE WHEN bool_or(r.flush_lsn IS NULL) THEN -1 ELSE min(r.flush_lsn - '0/0') END "
    "FROM pg_stat_replication r WHERE NOT EXISTS (SELECT FROM pg_replication_slots s "
    "WHERE s.active_pid = r.pid AND s.slot_type = 'logical'))"
)
#: The WAL position past every commit made so far, and :data:`STANDBYS_FLUSHED`.
POSITIONS_NOW = f"SELECT pg_current_wal_insert_lsn() - '0/0', {STANDBYS_FLUSHED}"
