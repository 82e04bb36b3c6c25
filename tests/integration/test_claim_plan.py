"""The unkeyed claim walks ``ix_outbox_due`` in order, in the plan PostgreSQL keeps for it.

psycopg prepares the claim on its fifth run, and PostgreSQL may then keep a generic plan for it,
planned without the parameters' values, until the next ANALYZE of the outbox. With the status
bound as a parameter, that plan could not use the partial index ``ix_outbox_due`` (its predicate
``status = 'pending'`` was not provable) and was a sequential scan of the whole table and a sort:
~28 ms per claim at 7,300 rows/s, and a confirm latency p50 of 64-124 ms instead of 23-34 in the
runs where it was chosen (docs/performance.md). The claim now writes 'pending' into the statement
and runs with sequential scans, bitmap scans and sorts off.

The statements checked are the ones production sends: captured from the engine while
``PublisherStore.claim`` runs, then prepared and explained with ``plan_cache_mode`` forcing the
generic plan, in one transaction with the statements sent before the claim. PostgreSQL only.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from app.outbox.read.stats import delayed_rows, status_counts
from app.outbox.records import Published
from app.outbox.states import Status
from tests.support.large_outbox import captured, plan_nodes
from tests.support.outbox_clients import OutboxClients

NOW = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)
SMALL, BACKLOG, CLAIM = 50, 20_000, 200


def add(engine: Engine, first: int, last: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body,
                                available_at, created_at)
            SELECT 'm-' || g, 'b:1', 'orders', 'r', convert_to(repeat('x', 200), 'UTF8'),
                   :now - make_interval(secs => 100000 - g), :now
            FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS g
        """),
            {"now": NOW, "first": first, "last": last},
        )


def generic_plan(
    engine: Engine, sent: list[tuple[str, Any]], first: str = "WITH"
) -> list[dict[str, Any]]:
    """The plan nodes of the claim's generic plan (or of the first statement sent that starts
    with ``first``): the plan PostgreSQL keeps for a prepared statement (psycopg prepares a
    statement on its fifth run), planned after the settings its transaction sends before it."""
    claim, parameters = next((s, p) for s, p in sent if s.lstrip().upper().startswith(first))
    names: list[str] = []  # psycopg's %(name)s -> $n, in order of first appearance

    def positional(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    with engine.begin() as conn:
        for statement, params in sent:
            if "set_config" in statement:
                conn.exec_driver_sql(statement, params)
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        # PREPARE and EXECUTE with literal arguments: the client-side cursor interpolates them
        cur = psycopg.ClientCursor(conn.connection.driver_connection)  # type: ignore[arg-type]
        cur.execute("PREPARE claim AS " + re.sub(r"%\((\w+)\)s", positional, claim))
        types = conn.exec_driver_sql(
            "SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = 'claim'"
        ).scalar_one()
        args = ", ".join(f"CAST(%({n})s AS {t})" for n, t in zip(names, types, strict=True))
        arguments = f"({args})" if args else ""  # nothing bound: EXECUTE takes no list
        cur.execute(f"EXPLAIN (FORMAT JSON) EXECUTE claim{arguments}", parameters)
        plan = cur.fetchone()[0]  # type: ignore[index]
        cur.execute("DEALLOCATE claim")
    return list(plan_nodes(plan[0]["Plan"]))


def walks_the_due_index(nodes: list[dict[str, Any]]) -> bool:
    scans = {
        (n["Node Type"], n.get("Index Name")) for n in nodes if n.get("Relation Name") == "outbox"
    }
    return (
        ("Index Scan", "ix_outbox_due") in scans
        and not {kind for kind, _ in scans} & {"Seq Scan", "Bitmap Heap Scan"}
        and "Sort" not in {n["Node Type"] for n in nodes}
    )


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_claim_walks_the_due_index_at_any_size_of_the_outbox(engine: Engine) -> None:
    repo = OutboxClients(engine, clock=lambda: NOW)
    add(engine, 1, SMALL)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE outbox"))
    first, sent = captured(engine, lambda: repo.store.claim(owner="p1", limit=10, lease_seconds=30))
    assert [r.id for r in first] == list(range(1, 11))
    # as the product sends it, the claim's generic plan walks the index
    assert walks_the_due_index(generic_plan(engine, sent))
    # the hazard: with 'pending' bound as a parameter, as it was, the generic plan cannot use
    # ix_outbox_due (its predicate is not provable) and reads the whole table and sorts it
    bound = [
        (
            s.replace("outbox.status = 'pending'", "outbox.status = %(due_status)s::VARCHAR"),
            {**p, "due_status": "pending"},
        )
        for s, p in sent
    ]
    assert bound != sent
    kinds = {n["Node Type"] for n in generic_plan(engine, bound)}
    assert "Sort" in kinds and "Seq Scan" in kinds, kinds

    add(engine, SMALL + 1, SMALL + BACKLOG)  # a backlog arrives; no ANALYZE since
    claimed, sent = captured(
        engine, lambda: repo.store.claim(owner="p1", limit=CLAIM, lease_seconds=30)
    )
    assert [r.id for r in claimed] == list(range(11, CLAIM + 11))  # the oldest, in order
    assert walks_the_due_index(generic_plan(engine, sent))


DELAYED = 100_000


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_delayed_rows_stay_out_of_the_claims_walk(engine: Engine) -> None:
    """100,000 delayed rows ahead of 50 due ones: the claim reads the due rows only. Writers set
    ``available_at`` to ``not_before`` (``app.outbox.enqueue``), so the walk of ix_outbox_due,
    ordered by ``available_at``, stops before them. Measured on the dev box: 0.7 ms per claim;
    with ``available_at`` left at the write time and ``not_before`` as a filter it was 47 ms,
    100,000 rows read and removed by the filter. Operators' count of the delayed rows reads
    ``ix_outbox_delayed`` alone (an index-only scan, 14 ms for the 100,000)."""
    with engine.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO outbox (message_id, batch_id, exchange, routing_key, body, not_before,
                                available_at, created_at)
            SELECT 'd-' || g, 'app', 'orders', 'r', convert_to(repeat('x', 200), 'UTF8'),
                   :now + make_interval(secs => 60 + g), :now + make_interval(secs => 60 + g),
                   :now - interval '1 hour'
            FROM generate_series(1, CAST(:n AS bigint)) AS g
        """),
            {"now": NOW, "n": DELAYED},
        )
    add(engine, 1, SMALL)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))
    repo = OutboxClients(engine, clock=lambda: NOW)
    claimed, sent = captured(
        engine, lambda: repo.store.claim(owner="p1", limit=CLAIM, lease_seconds=30)
    )
    assert [r.message_id for r in claimed] == [f"m-{g}" for g in range(1, SMALL + 1)]
    with engine.begin() as conn:  # the same claim again, explained, on the same rows
        conn.execute(
            text(
                "UPDATE outbox SET status = 'pending', lease_owner = NULL, "
                "lease_until = NULL WHERE status = 'in_flight'"
            )
        )
    claim, params = next((s, p) for s, p in sent if s.lstrip().upper().startswith("WITH"))
    with engine.begin() as conn:
        for statement, values in sent:
            if "set_config" in statement:
                conn.exec_driver_sql(statement, values)
        plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {claim}", params).scalar()
        conn.rollback()
    walk = [n for n in plan_nodes(plan[0]["Plan"]) if n.get("Index Name") == "ix_outbox_due"]
    assert len(walk) == 1 and walk[0]["Actual Rows"] == SMALL
    assert walk[0].get("Rows Removed by Filter", 0) == 0
    with engine.connect() as conn:  # the statement `outbox status` sends
        (delayed, _first), counted = captured(engine, lambda: delayed_rows(conn, now=NOW))
        assert delayed == DELAYED
        statement, values = counted[0]
        count = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", values).scalar()
    scans = {
        (n["Node Type"], n.get("Index Name"))
        for n in plan_nodes(count[0]["Plan"])
        if n.get("Relation Name") == "outbox"
    }
    assert scans == {("Index Only Scan", "ix_outbox_delayed")}, scans


#: (rows in the outbox, rows in flight, rows per write-back): the soak's shape (a large table,
#: small write-backs), and ``make bench``'s (a small table, flushes of 8,000 confirms)
SHAPES = [(300_000, 4_000, 800), (100_000, 32_000, 8_000)]


def outbox_scans(nodes: list[dict[str, Any]]) -> set[tuple[str, str | None]]:
    """How a plan reads ``outbox``: (node type, index) of each scan of it."""
    return {
        (n["Node Type"], n.get("Index Name"))
        for n in nodes
        if n.get("Relation Name") == "outbox" and n["Node Type"] != "ModifyTable"
    }


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize(("history", "in_flight", "written_back"), SHAPES)
def test_write_backs_look_their_rows_up_by_id_whatever_the_statistics(
    engine: Engine, history: int, in_flight: int, written_back: int
) -> None:
    """A confirm's write-back finds its rows by id (``outbox_pkey``), custom plan or generic,
    even when the last ANALYZE saw no row in flight and thousands are now.

    Seen in the soak: after an autovacuum ANALYZE that found next to no in-flight rows, the
    write-back's plan started from ``ix_outbox_lease`` (every in-flight row, and the dead
    entries of rows in flight since the last vacuum, estimated at one) and matched the ~800 ids
    in a join filter: 414-498 ms per write-back instead of a few, until the next ANALYZE. On
    this test's outbox with 20,000 rows in flight instead of 4,000 (measured once, by hand):
    30 ms instead of 11, and 13 ms instead of 1 for one that matched no row. The status
    condition of statements that find rows by id is now written so that it proves no partial
    index's predicate (``status_by_id``).

    Seen in ``make bench`` (the second shape): after an ANALYZE that saw no row leased,
    ``lease_owner = <owner>`` was estimated at one row, and a write-back of 8,000 ids against a
    100,000-row outbox read the table (sequentially, or all of outbox_pkey) and compared each
    leased row with every id: 3-38 s per write-back. Its owner and status checks are now join
    conditions, and its transaction plans with sequential scans and hash joins off
    (``OutboxDatabase.by_id``)."""
    repo = OutboxClients(engine, clock=lambda: NOW)
    add(engine, 1, history)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))  # nothing in flight, as the stats say
    # in claims of at most 4,000 rows: one claim of 32,000 kept its transaction idle past the
    # claim's 500 ms bound while the client read the rows, twice, on a CI machine whose other
    # worker was busy (the bound ended its session; a retried claim then failed the same way)
    held: list[Any] = []
    while len(held) < in_flight:
        limit = min(4000, in_flight - len(held))
        held += repo.store.claim(owner="p1", limit=limit, lease_seconds=30)
    assert len(held) == in_flight
    some = held[:written_back]
    published = [Published(r.id, 1, i + 1, NOW) for i, r in enumerate(some)]

    def part(k: int) -> list[int]:
        return [r.id for r in held[k * written_back : (k + 1) * written_back]]

    # (what runs, the statement explained: the first sent that starts so)
    checks = {
        "record_published": (
            lambda: repo.store.record_published(
                owner="p1", channel_id=1, tags=[(r.id, i + 1) for i, r in enumerate(some)]
            ),
            "UPDATE OUTBOX ",
        ),
        "confirm by publish": (
            lambda: repo.store.mark_confirmed(owner="p1", published=published),
            "UPDATE OUTBOX ",
        ),
        "confirm by id": (
            lambda: repo.store.mark_confirmed(owner="p1", ids=part(1)),
            "UPDATE OUTBOX ",
        ),
        "lease renewal of held rows": (
            lambda: repo.registry.heartbeat(publisher_id="p1", lease_seconds=30, held=part(2)),
            "UPDATE OUTBOX ",
        ),
        "failed, and its events": (
            lambda: repo.store.mark_failed(owner="p1", ids=part(3), reason="gone"),
            "INSERT INTO OUTBOX_EVENTS ",
        ),
    }
    for name, (run, first) in checks.items():
        moved, sent = captured(engine, run)
        assert moved == written_back, name
        statement, params = next((s, p) for s, p in sent if s.lstrip().upper().startswith(first))
        with engine.connect() as conn:  # after the settings its transaction sent
            for setting, values in sent:
                if "set_config" in setting:
                    conn.exec_driver_sql(setting, values)
            plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", params).scalar()
        custom = outbox_scans(list(plan_nodes(plan[0]["Plan"])))
        generic = outbox_scans(generic_plan(engine, sent, first=first))
        assert custom == generic == {("Index Scan", "outbox_pkey")}, (name, custom, generic)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_status_counts_read_their_partial_indexes_in_the_kept_plan(engine: Engine) -> None:
    """``outbox status``, ``/v1/stats`` and the console count pending, in-flight and set-aside
    rows from their partial indexes, in the generic plan too: with the status bound as a
    parameter that plan could prove no index's predicate and read the whole table (the API
    polls these counts; psycopg prepares them on their fifth run)."""
    add(engine, 1, SHAPES[0][0])
    with engine.begin() as conn:  # a queue's shape: nearly every row long confirmed
        conn.execute(text("UPDATE outbox SET status = 'confirmed' WHERE id > 2000"))
        conn.execute(text("UPDATE outbox SET status = 'failed' WHERE id <= 50"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))
    with engine.connect() as conn:
        (counts, _lost, _estimated), sent = captured(engine, lambda: status_counts(conn))
    assert counts[Status.PENDING] == 1950 and counts[Status.FAILED] == 50
    counting = [
        (s, p) for s, p in sent if s.lstrip().upper().startswith("SELECT") and "FROM outbox" in s
    ]
    assert len(counting) == 4  # pending, in flight, set aside, lost confirms (confirmed: estimated)
    for statement, params in counting:
        scans = outbox_scans(generic_plan(engine, [(statement, params)], first="SELECT"))
        assert scans and all(kind.startswith("Index") for kind, _ in scans), (statement, scans)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_by_id_settings_hold_for_their_transaction_only(engine: Engine) -> None:
    """``by_id`` sends its settings once per transaction (a flush's write-backs share one unit
    of work), and they end with it: the next transaction plans as the server is configured."""
    repo = OutboxClients(engine, clock=lambda: NOW)
    add(engine, 1, 40)
    held = [r.id for r in repo.store.claim(owner="p1", limit=40, lease_seconds=30)]
    db = repo.store.db

    def flush() -> str:
        with db.unit_of_work(), db.begin() as conn:
            repo.store.record_published(owner="p1", channel_id=1, tags=[(i, i) for i in held[:20]])
            repo.store.mark_confirmed(owner="p1", ids=held[:10])
            return str(conn.exec_driver_sql("SHOW enable_hashjoin").scalar())

    setting, sent = captured(engine, flush)
    assert setting == "off"
    assert sum("set_config" in s for s, _ in sent) == 1
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW enable_hashjoin").scalar() == "on"
    _, sent = captured(engine, lambda: repo.store.mark_confirmed(owner="p1", ids=held[10:20]))
    assert sum("set_config" in s for s, _ in sent) == 1  # a new transaction: sent again
