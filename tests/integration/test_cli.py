"""The ``outbox`` command line against real databases: tables, JSON, republish, exit codes.

Commands run in-process through :func:`app.cli.main` (fast); the console script and ``serve``
run as real subprocesses.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, func, inspect, select, update

from app.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, duration, main
from app.cli_output import plain_table
from app.db import make_engine
from app.outbox.schema import audit, inbox, outbox
from tests.support.api import OPERATOR, READ, Clock, Seeded, seed_every_state
from tests.support.cli import engine, env, run
from tests.support.factories import add_rows
from tests.support.outbox_clients import OutboxClients
from tests.support.serve import Served
from tests.support.tls import make_certificates

__all__ = ["engine", "env"]  # fixtures: OUTBOX_* scrubbed, the database's URL set

REPO = Path(__file__).resolve().parents[2]
COMMANDS = [
    "migrate",
    "publish",
    "serve",
    "status",
    "batches",
    "republish",
    "purge",
    "demo",
    "consume",
    "parked",
    "skip",
    "outstanding",
    "streams",
    "message",
    "failures",
    "audit",
    "declare",
    "rejects",
]


@pytest.fixture
def seeded(engine: Engine) -> Seeded:
    return seed_every_state(engine, Clock())


def statuses(engine: Engine, ids: list[str]) -> set[str]:
    stmt = select(outbox.c.status).where(outbox.c.message_id.in_(ids))
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


# --------------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    assert f"usage: outbox {command}" in capsys.readouterr().out


def test_the_console_script_runs_and_publish_help_needs_no_publisher() -> None:
    script = Path(sys.executable).parent / "outbox"
    top = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and all(c in top.stdout for c in COMMANDS)
    code = "import sys; sys.modules['app.publisher'] = None; from app.cli import main; main()"
    pub = subprocess.run(
        [sys.executable, "-c", code, "publish", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pub.returncode == 0, pub.stderr
    assert "usage: outbox publish" in pub.stdout


# ------------------------------------------------------------------------- status, batches


def test_status_prints_a_readable_table_and_json(
    env: str, seeded: Seeded, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "status")
    assert rc == EXIT_OK
    rows = [line.split() for line in out.splitlines()]
    for pair in (["pending", "2"], ["in_flight", "4"], ["failed", "2"], ["total", "15"]):
        assert pair in rows
    assert "possible duplicates   1" in out
    assert "publishers: 0 alive of 2 known" in out  # seeded heartbeats are old
    rc, out, _ = run(capsys, "status", "--json")
    body = json.loads(out)
    assert body["counts"]["returned"] == 2 and body["total"] == 15


def test_batches_table_json_one_batch_and_unknown_batch(
    env: str, seeded: Seeded, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "batches")
    assert rc == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split()[:8] == [
        "batch",
        "rows",
        "pending",
        "in_flight",
        "confirmed",
        "returned",
        "nacked",
        "failed",
    ]
    assert [line.split()[0] for line in lines[1:4]] == ["orders:2", "orders:1", "orders:3"]
    assert lines[2].split()[:8] == ["orders:1", "7", "0", "0", "3", "2", "2", "0"]
    rc, out, _ = run(capsys, "batches", "--status", "failed", "--json")
    assert [b["batch_id"] for b in json.loads(out)] == ["orders:2"]
    rc, out, _ = run(capsys, "batches", "orders:3")
    assert rc == EXIT_OK and "orders:3" in out
    rc, _, err = run(capsys, "batches", "nope")
    assert rc == EXIT_FAILURE and "no batch 'nope'" in err


# ---------------------------------------------------------------------------- republish


def test_republish_dry_run_then_real_then_replayed(
    env: str, seeded: Seeded, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["republish", "--batch", "orders:1", "--status", "nacked"]
    rc, out, _ = run(capsys, *args, "--dry-run")
    assert rc == EXIT_OK and "would republish 2 of 2" in out
    assert statuses(engine, seeded["nacked"]) == {"nacked"}

    rc, out, _ = run(capsys, *args, "--request-id", "inc-9", "--actor", "bob")
    assert rc == EXIT_OK and "republished 2 of 2" in out and "inc-9" in out
    assert statuses(engine, seeded["nacked"]) == {"pending"}
    with engine.connect() as conn:
        [row] = conn.execute(select(audit)).mappings().all()
    assert (row["actor"], row["count"], row["request_id"]) == ("bob", 2, "inc-9")

    rc, out, _ = run(capsys, *args, "--request-id", "inc-9", "--json")
    assert rc == EXIT_OK and json.loads(out)["replayed"] is True
    rc, _, err = run(capsys, "republish", "--status", "failed", "--request-id", "inc-9")
    assert rc == EXIT_USAGE and "already used" in err
    assert statuses(engine, seeded["failed"]) == {"failed"}


def test_republish_usage_errors_exit_2(env: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "republish")[0] == EXIT_USAGE  # no filter: refuse to move everything
    rc, _, err = run(
        capsys,
        "republish",
        "--status",
        "failed",
        "--created-after",
        "2026-01-02",
        "--created-before",
        "2026-01-01",
    )
    assert rc == EXIT_USAGE and "earlier" in err
    for bad in (["--status", "confirmed"], ["--limit", "0"], ["--created-after", "yesterday"]):
        with pytest.raises(SystemExit) as stop:
            main(["republish", *bad])
        assert stop.value.code == EXIT_USAGE
    rc, _, err = run(capsys, "republish", "--batch", "nope")
    assert rc == EXIT_FAILURE and "no batch" in err


# ---------------------------------------------------------------------------- exit codes


def test_unreachable_database_exits_1_and_bad_config_exits_2_without_echoing_secrets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql+psycopg://u:pw-s3cret@127.0.0.1:1/x")
    rc, _, err = run(capsys, "status")
    assert rc == EXIT_FAILURE and "database unavailable" in err and "s3cret" not in err
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "mysql://u:pw-s3cret@db/x")
    rc, _, err = run(capsys, "status")
    assert rc == EXIT_USAGE and "OUTBOX_DATABASE_URL" in err and "s3cret" not in err
    # issue 29, Low: an unescaped '@' splits the password; the driver quoted its tail as a host
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql+psycopg://u:pw@s3cret@127.0.0.1:1/x")
    rc, _, err = run(capsys, "status")
    assert rc == EXIT_FAILURE and "database unavailable" in err, err
    assert "s3cret" not in err and "%40" in err, err


def test_a_database_without_schema_exits_1_naming_migrate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    rc, _, err = run(capsys, "batches")
    assert rc == EXIT_FAILURE and "outbox migrate" in err
    rc, out, _ = run(capsys, "migrate")
    assert rc == EXIT_OK and "head" in out
    assert "outbox" in inspect(make_engine(url)).get_table_names()
    assert run(capsys, "batches")[0] == EXIT_OK


def test_serve_refuses_without_tokens_and_insecure_off_loopback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("OUTBOX_API_TOKEN", "OUTBOX_OPERATOR_TOKEN", "OUTBOX_API_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{tmp_path / 'o.db'}")
    rc, _, err = run(capsys, "serve")
    assert rc == EXIT_USAGE and "OUTBOX_API_TOKEN" in err and "--insecure" in err
    rc, _, err = run(capsys, "serve", "--insecure", "--host", "0.0.0.0")
    assert rc == EXIT_USAGE and "loopback" in err


def test_serve_refuses_a_guessable_token_from_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 48, Medium 1: `Operator-Pass-2026` was accepted, also through *_FILE."""
    for name in ("OUTBOX_API_TOKEN", "OUTBOX_OPERATOR_TOKEN", "OUTBOX_API_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    secret = tmp_path / "operator-token"
    secret.write_text("Operator-Pass-2026\n")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{tmp_path / 'o.db'}")
    monkeypatch.setenv("OUTBOX_OPERATOR_TOKEN_FILE", str(secret))
    rc, _, err = run(capsys, "serve")
    assert rc == EXIT_USAGE and "OUTBOX_OPERATOR_TOKEN is shorter than 32" in err, err
    assert "Operator-Pass" not in err and "outbox token" in err


def test_serve_really_starts_under_uvicorn_and_answers(sqlite_url: str) -> None:
    with Served.outbox(sqlite_url) as srv:
        health = httpx.get(f"{srv.base}/healthz", timeout=5)
        assert health.json() == {"status": "ok"}
        stats = httpx.get(f"{srv.base}/v1/stats", headers={"Authorization": f"Bearer {READ}"})
        assert stats.status_code == 200 and stats.json()["total"] == 0
        assert httpx.get(f"{srv.base}/v1/stats", timeout=5).status_code == 401
    assert READ not in srv.err and OPERATOR not in srv.err


def test_serve_access_lines_go_through_the_redacting_log_handler(sqlite_url: str) -> None:
    """Issue 29, Low: uvicorn's access and error lines were plain text and unredacted
    (``?access_token=`` logged verbatim), whatever OUTBOX_LOG_FORMAT said."""
    secret = "s3cret-in-a-query-0123456789"
    served = Served.outbox(sqlite_url, OUTBOX_LOG_FORMAT="json")
    served.args[served.args.index("--log-level") + 1] = "info"  # access lines are INFO
    with served as srv:
        r = httpx.get(f"{srv.base}/v1/stats?access_token={secret}", timeout=5)
        assert r.status_code in (401, 422), r.text
    assert secret not in srv.err
    lines = [json.loads(line) for line in srv.err.splitlines() if line.strip()]
    access = [d for d in lines if d["logger"] == "uvicorn.access" and "/v1/stats" in d["message"]]
    assert access and "access_token=***" in access[0]["message"], srv.err


def _audit_addresses(engine: Engine) -> list[str | None]:
    with engine.connect() as conn:
        return list(conn.execute(select(audit.c.client_addr).order_by(audit.c.id)).scalars())


def test_serve_trusts_no_forwarded_header_unless_told(sqlite_url: str) -> None:
    """Issue 29, Medium 2: uvicorn trusts X-Forwarded-For from 127.0.0.1 by default, so 200
    wrong tokens with forged addresses got 200 x 401 and no 429, and the audit stored the
    forged address. ``outbox serve`` now trusts no proxy unless ``--forwarded-allow-ips``."""
    engine = make_engine(sqlite_url)
    body = {"request_id": "fwd-1", "statuses": ["failed"], "dry_run": False}
    try:
        with Served.outbox(sqlite_url, OUTBOX_API_AUTH_FAILURES_PER_MINUTE="5") as srv:
            forged = {"Authorization": f"Bearer {OPERATOR}", "X-Forwarded-For": "203.0.113.9"}
            r = httpx.post(f"{srv.base}/v1/republish", json=body, headers=forged, timeout=5)
            assert r.status_code == 200, r.text
            codes = [
                httpx.get(
                    f"{srv.base}/v1/stats",
                    timeout=5,
                    headers={
                        "Authorization": f"Bearer wrong-token-{i:04d}-xxxxxxxx",
                        "X-Forwarded-For": f"198.51.100.{i}",
                    },
                ).status_code
                for i in range(8)
            ]
            assert codes == [401] * 5 + [429] * 3, codes
        assert _audit_addresses(engine) == ["127.0.0.1"]
        with Served.outbox(
            sqlite_url, "--forwarded-allow-ips", "127.0.0.1"
        ) as srv:  # behind a proxy
            r = httpx.post(
                f"{srv.base}/v1/republish",
                json={**body, "request_id": "fwd-2"},
                headers=forged,
                timeout=5,
            )
            assert r.status_code == 200, r.text
        assert _audit_addresses(engine) == ["127.0.0.1", "203.0.113.9"]
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ rendering


def test_table_and_duration_render_for_people() -> None:
    assert plain_table(["a", "n"], [("x", 1), ("long", 22)]).splitlines() == [
        "a      n",
        "x      1",
        "long  22",
    ]
    assert [duration(s) for s in (None, 0.25, 59, 3600 + 61, 90000)] == [
        "-",
        "250 ms",
        "59s",
        "1h 1m",
        "1d 1h",
    ]


def test_purge_deletes_only_confirmed_rows_past_retention(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    add_rows(engine, n=5)
    repo = OutboxClients(engine)
    rows = repo.store.claim(owner="p", limit=5, lease_seconds=30)
    repo.store.mark_confirmed(owner="p", ids=[r.id for r in rows[:4]])
    old = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    with engine.begin() as conn:  # three of them were confirmed ten days ago
        ids = [r.id for r in rows[:3]]
        conn.execute(update(outbox).where(outbox.c.id.in_(ids)).values(confirmed_at=old))
    from app.consumer import Message, handle_once

    for mid in ("old-1", "old-2", "new-1"):  # the consumer kit's inbox: 2 rows past retention
        msg = Message(message_id=mid, body=b"", routing_key="", exchange="")
        handle_once(engine, consumer="c", message=msg, handler=lambda m, c: None)
    month_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    with engine.begin() as conn:
        conn.execute(
            update(inbox).where(inbox.c.message_id.like("old-%")).values(received_at=month_ago)
        )
    rc, out, err = run(capsys, "purge", "--older-than-days", "7", "--dry-run")
    assert rc == 0 and "would delete 3 confirmed rows" in out, err
    rc, out, err = run(
        capsys, "purge", "--older-than-days", "7", "--chunk", "2", "--sleep-coef", "0.5"
    )
    assert rc == 0, err
    assert "deleted 3 confirmed rows" in out
    with engine.connect() as conn:
        (row,) = conn.execute(select(audit).where(audit.c.action == "purge")).mappings().all()
    assert row["count"] == 3 and row["result"]["inbox_deleted"] == 2
    # the audit keeps the pacing it ran with and how long it took
    assert row["filter"] == {"older_than_days": 7, "sleep_coef": 0.5}
    assert row["result"]["seconds"] >= 0
    assert "paced at --sleep-coef 0.5" in out
    assert "deleted 2 consumer inbox rows older than 14 days" in out
    with engine.connect() as conn:
        left = conn.execute(select(outbox.c.status, func.count()).group_by(outbox.c.status)).all()
    assert dict(left) == {"confirmed": 1, "in_flight": 1}


# ------------------------------------------------------------------------------ hardening


def test_the_insecure_switch_obeys_one_rule_whichever_way_it_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{tmp_path / 'o.db'}")
    monkeypatch.setenv("OUTBOX_API_INSECURE", "true")
    rc, _, err = run(capsys, "serve", "--host", "0.0.0.0")
    assert rc == EXIT_USAGE and "loopback addresses only" in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["purge", "--older-than-days", "-1"], "must be a positive, finite number of days"),
        (["purge", "--older-than-days", "0"], "must be a positive, finite number of days"),
        (["purge", "--older-than-days", "nan"], "must be a positive, finite number of days"),
        (["purge", "--older-than-days", "inf"], "must be a positive, finite number of days"),
        (["purge", "--older-than-days", "x"], "not a number of days"),
        (["purge", "--sleep-coef", "-1"], "must be within 0..100"),
        (["purge", "--sleep-coef", "nan"], "must be within 0..100"),
        (["purge", "--sleep-coef", "1e9"], "must be within 0..100"),
        (["purge", "--sleep-coef", "slow"], "not a number"),
        (["purge", "--every", "0"], "must be within 0.1..86400"),
        (["purge", "--every", "nan"], "must be within 0.1..86400"),
        (["purge", "--every", "soon"], "not a number"),
        (["purge", "--every", "5", "--dry-run"], "not allowed with argument --every"),
        (["purge", "--every", "5", "--audit-every", "0"], "must be within 1..86400"),
        (["purge", "--metrics-port", "9465"], "give --every too"),
        (["purge", "--every", "5", "--metrics-port", "65536"], "must be within 0..65535"),
        (["republish", "--limit", "0"], "must be within"),
        (["batches", "--status", "lost"], "invalid choice"),
        (["nosuchcommand"], "invalid choice"),
        (["serve", "--tls-cert", "/no/such.pem"], "both --tls-cert and --tls-key"),
        # texts kept in the audit trail: one line, bounded (as the API checks them)
        (["skip", "m-1", "--reason", "line one\nline two"], "one line, without control"),
        (["skip", "m-1", "--reason", "  "], "must be 1 to 1000 characters"),
        (["skip", "m-1", "--reason", "x", "--actor", "a" * 65], "must be 1 to 64 characters"),
        (["purge", "--actor", "\x1b[2Jforged"], "one line, without control"),
        (["republish", "--batch", "b", "--actor", "al\tice"], "one line, without control"),
        (["skip", "m-1", "--reason", "NEL\x85split"], "one line, without control"),
        (["skip", "m-1", "--reason", "line\u2028separator"], "one line, without control"),
        (["purge", "--actor", "ecila\u202e"], "one line, without control"),
        # bytes that are not UTF-8 (Python hands them over as lone surrogates)
        (["republish", "--exchange", "a\udcffb", "--dry-run"], "is not valid UTF-8"),
        (["skip", "m-\udcff", "--reason", "x"], "is not valid UTF-8"),
    ],
)
def test_every_bad_argument_is_one_line_and_exit_2(
    env: str, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        rc = main(argv)
    except SystemExit as stop:
        rc = int(stop.code or 0)
    out, err = capsys.readouterr()
    assert rc == EXIT_USAGE, (argv, out, err)
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_purge_metrics_port_in_use_is_one_line_and_exit_2(
    env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["purge", "--every", "5", "--metrics-port", str(port)])
    out, err = capsys.readouterr()
    assert rc == EXIT_USAGE, (out, err)
    assert f"--metrics-port {port}: " in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_closed_pipe_is_not_an_error(env: str, seeded: Seeded) -> None:
    """`outbox batches | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    envv = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    envv["OUTBOX_DATABASE_URL"] = env
    proc = subprocess.run(
        f"{sys.executable} -m app.cli batches --limit 500 | head -c 1 >/dev/null",
        shell=True,
        env=envv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_serve_speaks_https_with_its_certificate(sqlite_url: str, tmp_path: Path) -> None:
    make_certificates(tmp_path)
    trusted = ssl.create_default_context(cafile=tmp_path / "ca.pem")

    def stats(base: str) -> httpx.Response:
        url = base.replace("http://127.0.0.1", "https://localhost") + "/v1/stats"
        return httpx.get(
            url, timeout=2, verify=trusted, headers={"Authorization": f"Bearer {READ}"}
        )

    tls = ("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"))
    with Served.outbox(sqlite_url, *tls, ready=stats) as srv:
        answer = stats(srv.base)
        assert answer.status_code == 200
        assert answer.headers["strict-transport-security"] == "max-age=31536000"
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served on that port
            httpx.get(f"{srv.base}/healthz", timeout=2)


# ------------------------------------------------------------------------------ operators


def test_status_check_gives_a_monitoring_verdict_and_exit_code(
    seeded: Seeded, capsys: pytest.CaptureFixture[str]
) -> None:
    """The seed has terminal failures and old rows (its clock is days back): not OK."""
    rc, out, _ = run(capsys, "status", "--check")
    assert rc in (1, 2) and out.startswith(("WARNING:", "CRITICAL:")), out
    assert "returned, nacked or failed" in out and len(out.strip().splitlines()) == 1
    rc, out, _ = run(capsys, "status")
    assert rc == 0 and "verdict: " in out


def test_status_check_is_ok_on_an_empty_outbox(
    env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "status", "--check")
    assert (rc, out.strip()) == (0, "OK: rows flow, publishers alive")


def test_message_failures_and_audit_commands(
    seeded: Seeded, capsys: pytest.CaptureFixture[str]
) -> None:
    nacked = seeded["nacked"][0]
    rc, out, _ = run(capsys, "message", nacked)
    assert rc == 0 and "status" in out and "nacked" in out
    rc, _, err = run(capsys, "message", "nope")
    assert rc == EXIT_FAILURE and "no message 'nope'" in err
    rc, out, _ = run(capsys, "failures")
    assert rc == 0 and "nacked" in out and "returned" in out and "failed" in out
    rc, out, _ = run(capsys, "failures", "--json")
    groups = json.loads(out)["groups"]
    assert {g["status"] for g in groups} == {"returned", "nacked", "failed"}
    assert sum(g["rows"] for g in groups) == json.loads(out)["rows"]
    rc, out, _ = run(capsys, "republish", "--status", "nacked", "--actor", "bob")
    assert rc == 0
    rc, out, _ = run(capsys, "audit")
    assert rc == 0 and "republish" in out and "bob" in out
    rc, out, _ = run(capsys, "audit", "--json")
    assert json.loads(out)[0]["action"] == "republish"


def test_republish_says_when_its_limit_left_rows_behind_and_all_moves_them_in_chunks(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    add_rows(engine, n=7, exchange="limits")
    repo = OutboxClients(engine)
    rows = repo.store.claim(owner="p", limit=7, lease_seconds=30)
    repo.store.mark_failed(owner="p", ids=[r.id for r in rows], reason="exchange 'limits' missing")
    rc, out, err = run(capsys, "republish", "--exchange", "limits", "--limit", "3")
    assert rc == 3 and "4 matching rows were left behind by --limit 3" in err, (out, err)
    rc, out, err = run(capsys, "republish", "--exchange", "limits", "--limit", "2", "--all")
    assert rc == 0, err
    assert "in all: 4 rows republished in 3 chunks of at most 2" in out
    assert statuses(engine, [r.message_id for r in rows]) == {"pending"}


# ----------------------------------------------------------------- terminals, pipes, --json


def _on_a_terminal(
    argv: list[str], db: str, *, extra: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, str]:
    """``outbox ARGV`` with stdout and stderr on a pseudo-terminal: (exit code, what it drew)."""
    import pty
    import select as select_

    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") and k != "NO_COLOR"}
    env.update(OUTBOX_DATABASE_URL=db, TERM="xterm-256color", COLUMNS="160", **(extra or {}))
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", *argv],
        stdout=follower,
        stderr=follower,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=REPO,
    )
    os.close(follower)
    drawn = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select_.select([leader], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(timeout=10), drawn.decode(errors="replace")


def test_tables_and_colour_on_a_terminal_plain_when_piped_or_no_color(
    env: str, seeded: Seeded, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, drawn = _on_a_terminal(["failures"], env)
    assert rc == EXIT_OK and "\x1b[" in drawn, drawn  # colour
    assert "━" in drawn or "─" in drawn  # a drawn table
    assert "nacked" in drawn and "payments" in drawn
    rc, drawn = _on_a_terminal(["status"], env)
    assert rc == EXIT_OK and "\x1b[" in drawn and "verdict: CRITICAL" in drawn, drawn
    rc, drawn = _on_a_terminal(["failures"], env, extra={"NO_COLOR": "1"})
    assert rc == EXIT_OK and "\x1b[" not in drawn and "payments" in drawn
    rc, out, _ = run(capsys, "failures")  # captured: not a terminal
    assert "\x1b[" not in out and out.splitlines()[0].split() == [
        "rows",
        "status",
        "exchange/stream",
        "routing",
        "key",
        "reason",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["batches"],
        ["batches", "orders:1"],
        ["failures"],
        ["audit"],
        ["parked"],
        ["outstanding"],
        ["message", "order-1-0"],
        ["purge", "--dry-run"],
        ["migrate"],
        ["republish", "--status", "nacked", "--dry-run"],
    ],
)
def test_every_reporting_command_speaks_json(
    env: str, seeded: Seeded, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == EXIT_OK, err
    assert isinstance(json.loads(out), dict | list), out


def test_outstanding_lists_held_rows_with_channel_tag_and_age_in_pages(
    env: str, seeded: Seeded, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "outstanding")
    assert rc == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["message", "publisher", "channel/lane", "tag/id"]
    assert len(lines) == 1 + 4 and sum("not sent" in line for line in lines) == 1
    rc, out, _ = run(capsys, "outstanding", "--limit", "3")
    more = out.splitlines()[-1]
    assert more.startswith("more: outbox outstanding --cursor ")
    rc, out, _ = run(capsys, "outstanding", "--limit", "3", "--cursor", more.split()[-1])
    assert rc == EXIT_OK and len(out.splitlines()) == 1 + 1
    body = json.loads(run(capsys, "outstanding", "--publisher", "p2", "--json")[1])
    assert [o["publisher"] for o in body["items"]] == ["p2"]
    rc, _, err = run(capsys, "outstanding", "--cursor", "not-a-cursor")
    assert rc == EXIT_USAGE and err.startswith("outbox: --cursor:")


def test_republish_all_and_purge_show_progress_on_a_terminal(env: str, engine: Engine) -> None:
    add_rows(engine, n=9, exchange="bars")
    repo = OutboxClients(engine)
    rows = repo.store.claim(owner="p", limit=9, lease_seconds=30)
    repo.store.mark_failed(owner="p", ids=[r.id for r in rows], reason="exchange 'bars' missing")
    rc, drawn = _on_a_terminal(["republish", "--exchange", "bars", "--limit", "2", "--all"], env)
    assert rc == EXIT_OK, drawn
    assert "republish" in drawn and "9/9" in drawn, drawn  # the bar, complete
    assert "in all: 9 rows republished in 5 chunks of at most 2" in drawn
    rows = repo.store.claim(owner="p", limit=9, lease_seconds=30)
    repo.store.mark_confirmed(owner="p", ids=[r.id for r in rows])
    with engine.begin() as conn:
        conn.execute(update(outbox).values(confirmed_at=func.now() - dt.timedelta(days=30)))
    rc, drawn = _on_a_terminal(["purge", "--chunk", "4", "--older-than-days", "7"], env)
    assert rc == EXIT_OK and "purge" in drawn and "9/9" in drawn, drawn
    assert "deleted 9 confirmed rows" in drawn


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_texts_read_as_text_not_markup(
    command: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"] if command else ["--help"])
    shown = capsys.readouterr().out
    for markup in ("``", ":class:", ":func:", ":meth:", ".. "):
        assert markup not in shown, (command, markup)


async def _publish_to(amqp_url: str, exchange: str, routing_key: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        ex = await ch.get_exchange(exchange)  # passive: it must exist
        await ex.publish(aio_pika.Message(b"x"), routing_key=routing_key, mandatory=True)


async def _delete(amqp_url: str, name: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(amqp_url)
    async with conn:
        ch = await conn.channel()
        await ch.queue_delete(name)
        await ch.exchange_delete(name)


def test_declare_makes_the_exchange_and_a_bound_queue_idempotently(
    env: str, amqp_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    monkeypatch.setenv("OUTBOX_AMQP_URL", amqp_url)
    name = f"test-declare-{os.getpid()}-{time.monotonic_ns()}"
    argv = ["declare", name, "--queue", name, "--bind", "orders.#", "--json"]
    try:
        rc, out, err = run(capsys, *argv)
        assert rc == EXIT_OK, err
        assert json.loads(out) == {
            "exchange": name,
            "kind": "topic",
            "queue": name,
            "bindings": ["orders.#"],
            "queue_messages": 0,
            "queue_type": "classic",
            "delivery_limit": None,
        }
        asyncio.run(_publish_to(amqp_url, name, "orders.eu"))  # mandatory: routed to the queue
        rc, out, _ = run(capsys, *argv)  # again: nothing changes, the message is still there
        assert rc == EXIT_OK and json.loads(out)["queue_messages"] == 1
        rc, _, err = run(capsys, "declare", name, "--type", "direct")
        assert rc == EXIT_FAILURE and "the broker refused: 406 PRECONDITION_FAILED" in err, err
        rc, _, err = run(capsys, "declare", name, "--bind", "x")
        assert rc == EXIT_USAGE and "--bind needs --queue" in err
        rc, _, err = run(capsys, "declare", name, "--queue", name, "--delivery-limit", "5")
        assert rc == EXIT_USAGE and "needs a quorum queue" in err, err
    finally:
        asyncio.run(_delete(amqp_url, name))


# --------------------------------------------------------------------------------- publish


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_publish_until_empty_exits_once_drained_and_says_what_failed(
    env: str,
    engine: Engine,
    amqp_url: str,
    topology: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 48, item 11: a cron or Airflow task had to poll the table and send SIGTERM.
    ``outbox publish --until-empty`` stops once no row is in flight or due soon (a message
    delayed to tomorrow is the next run's), exits 0 when every row of the run was confirmed
    and 1 when some ended failed, returned or nacked."""
    monkeypatch.setenv("OUTBOX_AMQP_URL", amqp_url)
    monkeypatch.setenv("OUTBOX_PUBLISHER_METRICS_PORT", "0")
    monkeypatch.setenv("OUTBOX_RETURN_GRACE", "0")
    add_rows(engine, n=20, exchange=topology["exchange"], routing_key="rk")
    tomorrow = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    add_rows(engine, n=1, exchange=topology["exchange"], routing_key="rk", available_at=tomorrow)
    rc, out, _ = run(capsys, "publish", "--until-empty")
    assert rc == EXIT_OK, out
    assert "drained: 20 confirmed, 0 failed, 0 returned" in out
    add_rows(engine, n=2, exchange=topology["exchange"], routing_key="nobody-listens")
    rc, out, err = run(capsys, "publish", "--until-empty")
    assert rc == EXIT_FAILURE
    assert "0 confirmed, 0 failed, 2 returned" in out
    assert "2 rows ended failed, returned or nacked" in err
    with engine.connect() as conn:
        counts = dict(conn.execute(select(outbox.c.status, func.count()).group_by("status")).all())
    assert counts == {"confirmed": 20, "returned": 2, "pending": 1}
