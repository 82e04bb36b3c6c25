"""A PostgreSQL primary and a streaming standby of its own, on free loopback ports, for the tests
of what a failover does to the product (issue 49). Plain ``initdb`` and ``pg_basebackup``, no
Patroni (``deploy/local/pg-ha.sh`` has that, for the fault matrix): a switchover here is the
primary stopped and the standby promoted, in about a second.

Data in a directory of its own under /var/tmp (the postgres user must reach it; PostgreSQL
refuses to run as root), removed by :meth:`PgPair.stop`. Only processes it started are ever
signalled: their pids come from their own ``postmaster.pid``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from tests.support.serve import free_port

PG_BIN = Path(os.environ.get("OUTBOX_PG_BIN", "/usr/lib/postgresql/15/bin"))
PASSWORD = "outbox"
#: the product's role: may read the standbys' positions (pg_read_all_stats), as documented
ROLE = "outbox"
#: a role without pg_read_all_stats: sees that a standby streams, not how far it is
PLAIN_ROLE = "outbox_plain"


def _as_postgres(*args: str | Path, timeout: float = 120) -> str:
    cmd = [str(a) for a in args]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    return done.stdout


def missing() -> str | None:
    """Why a pair cannot start here (None: it can)."""
    if not (PG_BIN / "initdb").exists() or not (PG_BIN / "pg_basebackup").exists():
        return f"PostgreSQL binaries not in {PG_BIN}"
    return None


@dataclass
class PgPair:
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="outbox-pgpair-")))
    primary_port: int = field(default_factory=free_port)
    standby_port: int = field(default_factory=free_port)

    @property
    def primary_dir(self) -> Path:
        return self.root / "primary"

    @property
    def standby_dir(self) -> Path:
        return self.root / "standby"

    # ------------------------------------------------------------ life

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self.root.chmod(0o755)
        _as_postgres(
            PG_BIN / "initdb", "-D", self.primary_dir, "-U", "postgres",
            "--auth-local=trust", "--auth-host=trust", "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        conf = (
            f"listen_addresses = '127.0.0.1'\nport = {self.primary_port}\n"
            "unix_socket_directories = ''\nwal_level = replica\nmax_wal_senders = 5\n"
            "hot_standby = on\nfsync = off\nfull_page_writes = off\nshared_buffers = 32MB\n"
        )
        with (self.primary_dir / "postgresql.conf").open("a") as f:
            f.write(conf)
        with (self.primary_dir / "pg_hba.conf").open("a") as f:
            f.write("host replication all 127.0.0.1/32 trust\n")
        self._pg_ctl(self.primary_dir, "start")
        with self.connect(self.primary_port, user="postgres", dbname="postgres") as conn:
            conn.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
            conn.execute(f"GRANT pg_read_all_stats TO {ROLE}")
            conn.execute(f"CREATE ROLE {PLAIN_ROLE} LOGIN PASSWORD '{PASSWORD}'")
            conn.execute(f"CREATE DATABASE outbox OWNER {ROLE}")
        _as_postgres(
            PG_BIN / "pg_basebackup", "-D", self.standby_dir, "-h", "127.0.0.1",
            "-p", self.primary_port, "-U", "postgres", "-R", "-X", "stream", "--no-sync",
            "-c", "fast",
        )  # fmt: skip
        with (self.standby_dir / "postgresql.conf").open("a") as f:
            f.write(f"port = {self.standby_port}\n")
        self._pg_ctl(self.standby_dir, "start")
        self.wait_streaming()

    def stop(self) -> None:
        for data in (self.primary_dir, self.standby_dir):
            if (data / "postmaster.pid").exists():
                self.thaw_receiver()
                try:
                    self._pg_ctl(data, "stop", "-m", "immediate")
                except (RuntimeError, subprocess.TimeoutExpired):
                    pid = self._postmaster_pid(data)
                    if pid:
                        os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _pg_ctl(self, data: Path, action: str, *extra: str) -> None:
        _as_postgres(PG_BIN / "pg_ctl", "-D", data, "-l", data / "server.log", "-w", "-t", "60",
                     action, *extra)  # fmt: skip

    @staticmethod
    def _postmaster_pid(data: Path) -> int | None:
        try:
            return int((data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    # ------------------------------------------------------------ what tests use

    def url(self, *, order: tuple[str, ...] = ("standby", "primary"), user: str = ROLE) -> str:
        """The product's multi-host URL: the standby first, so the primary is found by
        ``target_session_attrs=read-write``, not by its place in the list."""
        ports = {"primary": self.primary_port, "standby": self.standby_port}
        hosts = "&".join(f"host=127.0.0.1:{ports[n]}" for n in order)
        return (
            f"postgresql+psycopg://{user}:{PASSWORD}@/outbox?{hosts}"
            "&target_session_attrs=read-write"
        )

    def connect(
        self, port: int, *, user: str = "postgres", dbname: str = "outbox"
    ) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host="127.0.0.1", port=port, user=user, dbname=dbname, password=PASSWORD,
            autocommit=True, connect_timeout=5,
        )  # fmt: skip

    def wait_streaming(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self.connect(self.primary_port, dbname="postgres") as conn:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                ).fetchone()
            if row and row[0]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the standby never streamed")
            time.sleep(0.05)

    def caught_up(self, timeout: float = 30) -> None:
        """Wait until the standby has on disk everything the primary wrote so far."""
        with self.connect(self.primary_port, dbname="postgres") as conn:
            deadline = time.monotonic() + timeout
            while True:
                row = conn.execute(
                    "SELECT bool_and(flush_lsn >= pg_current_wal_insert_lsn()) "
                    "FROM pg_stat_replication"
                ).fetchone()
                if row and row[0]:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError("the standby did not catch up")
                time.sleep(0.02)

    def _receiver_pid(self) -> int | None:
        with self.connect(self.standby_port, dbname="postgres") as conn:
            row = conn.execute("SELECT pid FROM pg_stat_wal_receiver").fetchone()
        return int(str(row[0])) if row and row[0] else None

    def freeze_receiver(self) -> None:
        """SIGSTOP the standby's WAL receiver: it falls behind, as an asynchronous standby
        does under load or across a slow link."""
        pid = self._receiver_pid()
        assert pid is not None, "no WAL receiver on the standby"
        self._frozen = pid
        os.kill(pid, signal.SIGSTOP)

    def thaw_receiver(self) -> None:
        pid = getattr(self, "_frozen", None)
        if pid is not None:
            self._frozen = None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def switchover(self) -> None:
        """A planned switchover: the primary stopped (a fast shutdown sends the standby every
        WAL record first), then the standby promoted."""
        self._pg_ctl(self.primary_dir, "stop", "-m", "fast")
        self._pg_ctl(self.standby_dir, "promote")
