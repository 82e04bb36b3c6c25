"""A real server in a subprocess on a free loopback port: ``outbox serve``, or any ASGI app under
uvicorn, started with an environment scrubbed of ``OUTBOX_*`` and waited for until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from tests.support.api import OPERATOR, READ
from tests.support.env import REPO, scrubbed_environ

START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """``python -m <module> <args>`` (``app.cli serve`` by default: :meth:`outbox`), its port
    ``port`` free on loopback; entered once ``ready(base)`` answers (and not with False),
    stopped on exit (its stderr then in ``err``)."""

    def __init__(
        self,
        module_args: list[str],
        *,
        env: dict[str, str],
        port: int | None = None,
        ready: Callable[[str], object] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {**scrubbed_environ(os.environ), **env}
        self.args = module_args
        self.ready = ready or (lambda base: httpx.get(f"{base}/healthz", timeout=1))
        self.err = ""

    @classmethod
    def outbox(
        cls, db_url: str, *args: str, ready: Callable[[str], object] | None = None, **env: str
    ) -> Served:
        """``outbox serve`` on ``db_url`` with the suite's read and operator tokens."""
        port = free_port()
        env = {
            "OUTBOX_DATABASE_URL": db_url,
            "OUTBOX_API_TOKEN": READ,
            "OUTBOX_OPERATOR_TOKEN": OPERATOR,
            **env,
        }
        argv = ["app.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
        return cls(argv, env=env, port=port, ready=ready)

    def __enter__(self) -> Served:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *self.args],
            env=self.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.ready(self.base) is not False:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise AssertionError(f"{' '.join(self.args[:2])} did not start: {self.err[-2000:]}")

    def __exit__(self, *_exc: object) -> None:
        self.proc.terminate()
        try:
            _, self.err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.err = self.proc.communicate(timeout=5)
