"""A private RabbitMQ and PostgreSQL for the matrix, driven through ``deploy/local/services.sh``.

Same script as ``make services``, other ports and another data directory: the matrix may stop,
kill and restart these servers without touching the shared ones. Every destructive call checks
that it aims at the private instance.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICES = REPO / "deploy" / "local" / "services.sh"
CLUSTER = REPO / "deploy" / "local" / "cluster.sh"
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
#: the matrix's three-node cluster: AMQP on 5781-5783 (distribution +20000), data in .local/chaos
MATRIX_CLUSTER_PORT = 5781
#: ``make chaos`` and the harness checks in ``make test`` use different instances: both can run.
MATRIX_PORTS = (5683, 5443)
_KEEP_ENV = ("OUTBOX_PG_BIN",)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, also: Callable[[int], int] | None = None, tries: int = 200) -> int:
    """A loopback port free now (and ``also(port)`` free too), from 20000-39999."""
    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(20_000, 40_000)
        if _bindable(port) and (also is None or _bindable(also(port))):
            return port
    raise RuntimeError("no free loopback port found")


class ServiceError(RuntimeError):
    """A private service did not start, stop or answer as expected."""


def run_script(script: Path, *args: str, local_dir: str, timeout: float, **settings: object) -> str:
    """Run one of ``deploy/local``'s scripts (the cluster, the Patroni pair, the network
    namespaces) with an environment scrubbed of the shell's ``OUTBOX_*``, its data under
    ``local_dir`` and ``settings`` as ``OUTBOX_<NAME>``; its stdout, or ServiceError."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_LOCAL_DIR"] = local_dir
    env.update({f"OUTBOX_{k.upper()}": str(v) for k, v in settings.items()})
    proc = subprocess.run(
        [str(script), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if proc.returncode != 0:
        raise ServiceError(
            f"{script.name} {' '.join(args)} failed ({proc.returncode}): "
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return proc.stdout


@dataclass(frozen=True)
class PrivateServices:
    """RabbitMQ on ``amqp_port`` and PostgreSQL on ``pg_port``, data under ``local_dir``."""

    local_dir: Path
    amqp_port: int
    pg_port: int
    log: list[str] = field(default_factory=list, compare=False)

    @classmethod
    def for_matrix(cls, lane: int = 0) -> PrivateServices:
        """The matrix's servers; lane K of ``chaos.run --lanes`` has its own, 10 K ports up."""
        return cls(
            local_dir=REPO / ".local" / ("chaos" if lane == 0 else f"chaos-lane{lane}"),
            amqp_port=MATRIX_PORTS[0] + 10 * lane,
            pg_port=MATRIX_PORTS[1] + 10 * lane,
        )

    @classmethod
    def for_tests(cls) -> PrivateServices:
        """Free ports picked now and a data directory of their own: two test runs (two clones,
        a CI run beside a developer's) never share, nor stop, each other's servers."""
        amqp_port = free_port(also=lambda p: p + 20_000)  # the broker's distribution port
        pg_port = free_port()
        return cls(
            local_dir=REPO / ".local" / "chaos-test" / str(amqp_port),
            amqp_port=amqp_port,
            pg_port=pg_port,
        )

    # ------------------------------------------------------------ addresses

    @property
    def node(self) -> str:
        return f"outbox-{self.amqp_port}@localhost"

    @property
    def amqp_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    def pg_url(self, database: str = "outbox") -> str:
        return f"postgresql+psycopg://outbox:outbox@127.0.0.1:{self.pg_port}/{database}"

    @property
    def env(self) -> dict[str, str]:
        """The environment for ``services.sh``: no inherited ``OUTBOX_*`` (a node name exported
        for the shared broker would otherwise redirect ``ctl`` to it)."""
        base = {
            k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k in _KEEP_ENV
        }
        return {
            **base,
            "OUTBOX_LOCAL_DIR": str(self.local_dir),
            "OUTBOX_LOCAL_AMQP_PORT": str(self.amqp_port),
            "OUTBOX_LOCAL_PG_PORT": str(self.pg_port),
            "OUTBOX_LOCAL_RABBIT_NODE": self.node,
        }

    # ------------------------------------------------------------ services.sh

    def _script(self, *args: str, timeout: float = 180.0) -> str:
        proc = subprocess.run(
            [str(SERVICES), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        self.log.append(f"services.sh {' '.join(args)} -> {proc.returncode}")
        if proc.returncode != 0:
            raise ServiceError(
                f"services.sh {' '.join(args)} failed ({proc.returncode}): "
                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        return proc.stdout

    def start(self) -> None:
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self._script("start")

    def stop(self) -> None:
        self._script("stop", timeout=120)

    def remove_data(self) -> None:
        """Delete the data directory (only after :meth:`stop`), and the PostgreSQL data the script
        keeps under /var/tmp when the postgres user cannot reach ``local_dir`` (root, private
        checkout): the same path ``services.sh`` derives from ``local_dir``."""
        shutil.rmtree(self.local_dir, ignore_errors=True)
        digest = hashlib.md5(str(self.local_dir).encode()).hexdigest()[:12]
        shutil.rmtree(Path("/var/tmp") / f"outbox-local-{digest}", ignore_errors=True)

    def start_rabbitmq(self) -> None:
        self._script("start", "rabbitmq")

    def stop_rabbitmq(self) -> None:
        """``rabbitmqctl stop`` of the private broker (graceful: the node exits)."""
        self._script("stop", "rabbitmq", timeout=120)

    def stop_postgres(self) -> None:
        """``pg_ctl stop -m fast`` of the private PostgreSQL."""
        self._script("stop", "postgres", timeout=120)

    def start_postgres(self) -> None:
        self._script("start", "postgres")

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl -n <private node> ARGS`` (the script always passes our node)."""
        return self._script("ctl", *args, timeout=timeout)

    def restart_postgres(self) -> None:
        self.stop_postgres()
        self.start_postgres()

    def crash_postgres(self) -> None:
        """``kill -9`` of every PostgreSQL process at once, then a start (crash recovery)."""
        self._script("crash", "postgres", timeout=60)
        self._script("start", "postgres")

    # ------------------------------------------------------------ the broker process

    @property
    def broker_pid_file(self) -> Path:
        return self.local_dir / "rabbitmq" / "rabbitmq.pid"

    def broker_pid(self) -> int:
        pid = int(self.broker_pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if str(self.local_dir / "rabbitmq") not in cmdline:
            raise ServiceError(f"pid {pid} is not the private broker of {self.local_dir}")
        return pid

    def kill_broker(self, *, timeout: float = 30.0) -> int:
        """``kill -9`` the private broker's Erlang VM; returns its pid once it is gone."""
        pid = self.broker_pid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while Path(f"/proc/{pid}").exists():
            status = Path(f"/proc/{pid}/status")
            try:
                if "State:\tZ" in status.read_text():
                    break
            except OSError:
                break
            if time.monotonic() > deadline:
                raise ServiceError(f"broker pid {pid} still alive {timeout}s after SIGKILL")
            time.sleep(0.05)
        return pid

    def read_env(self, key: str) -> str:
        """``application:get_env(rabbit, KEY)`` as the broker prints it."""
        return self.ctl("eval", f"application:get_env(rabbit, {key}).").strip()

    def memory_watermark(self) -> str:
        return self.ctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().").strip()


class ArmedEval:
    """A ``rabbitmqctl eval`` started ahead of the fault that waits, inside the broker node, for
    a trigger file and then runs ``action`` (Erlang).

    ``rabbitmqctl`` needs a second or more to start on a busy machine: a fault issued as a plain
    command can land after the drain it was meant to hit. Armed, it lands within ~10 ms of
    :meth:`fire`. The actions are what the plain commands call (``rabbit:stop()`` for
    ``stop_app``, ``rabbit_networking:close_all_connections/1``, ``vm_memory_monitor:
    set_vm_memory_high_watermark/1``).
    """

    def __init__(
        self, services: PrivateServices, action: str, *, workdir: Path, wait_seconds: float = 300.0
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.armed_file = workdir / "armed"
        self.trigger_file = workdir / "fire"
        for path in (self.armed_file, self.trigger_file):
            path.unlink(missing_ok=True)
        polls = int(wait_seconds / 0.005)
        self.expression = (
            f'file:write_file("{self.armed_file}", <<"armed">>), '
            f"(fun Wait(N) when N > 0 -> "
            f'case filelib:is_file("{self.trigger_file}") of '
            f"true -> {action}; false -> timer:sleep(5), Wait(N - 1) end; "
            f"Wait(_) -> not_fired end)({polls})."
        )
        self.services = services
        self.proc: subprocess.Popen[str] | None = None

    def arm(self, *, timeout: float = 60.0) -> None:
        """Start the command and wait until it runs inside the node."""
        self.proc = subprocess.Popen(
            [str(SERVICES), "ctl", "eval", self.expression],
            env=self.services.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while not self.armed_file.exists():
            if self.proc.poll() is not None:
                out = self.proc.stdout.read() if self.proc.stdout else ""
                raise ServiceError(f"armed rabbitmqctl eval ended early: {out[-2000:]}")
            if time.monotonic() > deadline:
                self.disarm()
                raise ServiceError("armed rabbitmqctl eval did not start in time")
            time.sleep(0.02)

    def fire(self) -> None:
        self.trigger_file.write_text("fire")

    def result(self, *, timeout: float = 60.0) -> str:
        """Wait for the command to finish; its output (the action's value)."""
        assert self.proc is not None
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.disarm()
            raise ServiceError("armed rabbitmqctl eval did not finish") from None
        if self.proc.returncode != 0:
            raise ServiceError(f"armed rabbitmqctl eval failed: {out[-2000:]}")
        return out.strip()

    def disarm(self) -> None:
        """Stop waiting (the node-side loop ends on its own once its CLI is gone or times out)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def rabbitmq_missing() -> str | None:
    """Why a cluster cannot run here (None: it can)."""
    if not RABBITMQ_SERVER.exists() and shutil.which("rabbitmq-server") is None:
        return "rabbitmq-server is not installed (Debian package rabbitmq-server)"
    return None


@dataclass(frozen=True)
class Cluster:
    """A three-node RabbitMQ cluster on loopback driven through ``deploy/local/cluster.sh``:
    node N on ``base_port + N - 1``, data under ``local_dir``/cluster-<base port>. For the tests
    and the fault matrix (each with its own ports)."""

    base_port: int
    local_dir: str

    @classmethod
    def for_matrix(cls) -> Cluster:
        return cls(base_port=MATRIX_CLUSTER_PORT, local_dir=str(REPO / ".local" / "chaos"))

    def run(self, *args: str, timeout: float = 180) -> str:
        return run_script(
            CLUSTER, *args, local_dir=self.local_dir, timeout=timeout, cluster_port=self.base_port
        )

    def port(self, node: int) -> int:
        return self.base_port + node - 1

    def node_url(self, node: int) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port(node)}/"

    def url_of(self, nodes: tuple[int, ...] = (1, 2, 3)) -> str:
        """A multi-host URL of these nodes (failover)."""
        hosts = ",".join(f"127.0.0.1:{self.port(n)}" for n in nodes)
        return f"amqp://guest:guest@{hosts}/"

    @property
    def url(self) -> str:
        return self.url_of()

    def node_of_port(self, port: int) -> int:
        return port - self.base_port + 1

    def leader(self, queue: str) -> int:
        return int(self.run("leader", queue).strip())

    def start(self) -> None:
        Path(self.local_dir).mkdir(parents=True, exist_ok=True)
        self.run("start", timeout=300)

    def stop(self) -> None:
        self.run("stop", timeout=300)

    def kill(self, node: int) -> None:
        self.run("kill", str(node))

    def stop_node(self, node: int) -> None:
        self.run("stop", str(node), timeout=120)

    def start_node(self, node: int) -> None:
        self.run("start-node", str(node), timeout=300)

    def freeze(self, node: int) -> None:
        """SIGSTOP of node N's VM: its sockets stay open, nothing answers (a hung node)."""
        self.run("freeze", str(node))

    def thaw(self, node: int) -> None:
        self.run("thaw", str(node))

    def running_nodes(self, node: int) -> int:
        """How many nodes node N sees running in the cluster (0 if it does not answer)."""
        try:
            out = self.run("ctl", str(node), "cluster_status", "--formatter", "json", timeout=30)
        except (ServiceError, subprocess.TimeoutExpired):
            return 0
        return len(json.loads(out).get("running_nodes", []))
