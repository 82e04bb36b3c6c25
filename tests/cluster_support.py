"""A three-node RabbitMQ cluster on loopback for the tests (``deploy/local/cluster.sh``): its own
ports (``OUTBOX_TEST_CLUSTER_PORT``, default 5791, nodes on that and the next two) and data under
``OUTBOX_TEST_LOCAL_DIR``; started by a session fixture and stopped after the session."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "deploy" / "local" / "cluster.sh"
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")


def rabbitmq_missing() -> str | None:
    """Why the cluster cannot run here (None: it can)."""
    if not RABBITMQ_SERVER.exists() and shutil.which("rabbitmq-server") is None:
        return "rabbitmq-server is not installed (Debian package rabbitmq-server)"
    return None


@dataclass(frozen=True)
class Cluster:
    """The cluster's ports and the script's verbs, for tests and the fault matrix."""

    base_port: int
    local_dir: str

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["OUTBOX_CLUSTER_PORT"] = str(self.base_port)
        env["OUTBOX_LOCAL_DIR"] = self.local_dir
        return env

    def run(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run([str(CLUSTER), *args], check=True, capture_output=True, text=True,
                              timeout=timeout, env=self.env())  # fmt: skip
        return done.stdout

    def port(self, node: int) -> int:
        return self.base_port + node - 1

    def node_url(self, node: int) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port(node)}/"

    @property
    def url(self) -> str:
        """All three hosts, for failover."""
        hosts = ",".join(f"127.0.0.1:{self.port(n)}" for n in (1, 2, 3))
        return f"amqp://guest:guest@{hosts}/"

    def node_of_port(self, port: int) -> int:
        return port - self.base_port + 1

    def leader(self, queue: str) -> int:
        return int(self.run("leader", queue).strip())

    def start(self) -> None:
        self.run("start", timeout=300)

    def stop(self) -> None:
        self.run("stop", timeout=300)

    def kill(self, node: int) -> None:
        self.run("kill", str(node))

    def stop_node(self, node: int) -> None:
        self.run("stop", str(node))

    def start_node(self, node: int) -> None:
        self.run("start-node", str(node), timeout=300)
