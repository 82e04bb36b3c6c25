"""Processes the matrix starts: publishers (``python -m app.publisher``) and the Spark driver.

Each runs in its own session (process group) with its output in a log file, is registered in
:data:`LIVE` and is killed (SIGKILL, whole group) by :func:`kill_all` whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from chaos.services import REPO

LIVE: set[Proc] = set()

#: Publisher settings shared by every scenario (a scenario overrides what it needs).
PUBLISHER_ENV = {
    "OUTBOX_WINDOW": "1000",
    "OUTBOX_CLAIM_BATCH": "250",
    "OUTBOX_LEASE_SECONDS": "10",
    "OUTBOX_POLL_INTERVAL": "0.05",
    "OUTBOX_FLUSH_INTERVAL": "0.02",
    "OUTBOX_HEARTBEAT": "5",
    "OUTBOX_CONFIRM_TIMEOUT": "15",
    "OUTBOX_RECONNECT_MAX_DELAY": "1",
    "OUTBOX_BACKOFF_BASE": "0.1",
    "OUTBOX_BACKOFF_MAX": "2",
    "OUTBOX_SHUTDOWN_TIMEOUT": "5",
    "OUTBOX_PUBLISHER_HEARTBEAT_INTERVAL": "1",
    "OUTBOX_DESTINATION_RETRY_BUDGET": "5",
    "OUTBOX_PUBLISHER_METRICS_PORT": "0",
}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``OUTBOX_*`` (they may point at the shared
    services), plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**base, **extra}


@dataclass(eq=False)
class Proc:
    """A child process in its own process group, output to ``log_path``."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv,
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started_at = time.monotonic()
        LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self, *, group: bool = False) -> int | None:
        """SIGKILL the process (or its whole group) and reap it; returns its exit code."""
        if self.popen is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                self.popen.send_signal(signal.SIGKILL)
        return self._reap(timeout=30)

    def terminate(self, *, timeout: float = 30.0) -> int | None:
        """SIGTERM (a graceful stop for the publisher), SIGKILL after ``timeout``."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
        return self._reap(timeout=timeout)

    def wait(self, *, timeout: float) -> int | None:
        """Wait for the process to end by itself; None if it is still running."""
        assert self.popen is not None
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def _reap(self, *, timeout: float) -> int | None:
        assert self.popen is not None
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            code = self.popen.wait(timeout=10)
        self._close()
        return code

    def _close(self) -> None:
        # the group may still hold children (Spark's JVM and workers): never leave them behind.
        # A process group id cannot be reused while a member lives, so this kills only ours.
        if group_members(self.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        LIVE.discard(self)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def publisher(
    *, name: str, db_url: str, amqp_url: str, log_path: Path, env: dict[str, str] | None = None
) -> Proc:
    """A publisher process (not started) with :data:`PUBLISHER_ENV` and ``env`` on top; with
    ``CHAOS_SETTLEMENT=ranges`` in the matrix's environment, settling by ranges on PostgreSQL."""
    settings = {
        **PUBLISHER_ENV,
        "OUTBOX_DATABASE_URL": db_url,
        "OUTBOX_AMQP_URL": amqp_url,
        "OUTBOX_PUBLISHER_ID": name,
        **(env or {}),
    }
    if os.environ.get("CHAOS_SETTLEMENT") == "ranges" and db_url.startswith("postgresql"):
        settings.setdefault("OUTBOX_SETTLEMENT", "ranges")  # the matrix on ranges (issue 47)
    environ = clean_env(**settings)
    return Proc(
        name=name, argv=[sys.executable, "-m", "app.publisher"], env=environ, log_path=log_path
    )


def kill_all() -> None:
    """SIGKILL every process group the matrix started that is still there."""
    for proc in list(LIVE):
        with contextlib.suppress(Exception):
            proc.kill9(group=True)
