"""The deploy files parse, and every OUTBOX_* variable they set is one the settings read."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from app.cli import build_parser
from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
YAMLS = sorted([*DEPLOY.glob("*.yml"), *DEPLOY.glob("k8s/*.yaml")])
ENV_FILES = sorted([*DEPLOY.glob("systemd/*"), DEPLOY / "Dockerfile"])
KNOWN = {f"OUTBOX_{name.upper()}" for name in Settings.model_fields}
# Variables the deploy scripts read themselves (not the service's settings).
LOCAL_ONLY = {
    "OUTBOX_LOCAL_DIR",
    "OUTBOX_LOCAL_AMQP_PORT",
    "OUTBOX_LOCAL_PG_PORT",
    "OUTBOX_LOCAL_RABBIT_NODE",
    "OUTBOX_PG_BIN",
    "OUTBOX_KEEP",
}


def _docs(path: Path) -> list[object]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _env_names(node: object) -> set[str]:
    """OUTBOX_* names set anywhere in a parsed YAML tree (env maps, env lists, ConfigMap data)."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str) and key.startswith("OUTBOX_"):
                found.add(key)
            if key == "name" and isinstance(value, str) and value.startswith("OUTBOX_"):
                found.add(value)
            found |= _env_names(value)
    elif isinstance(node, list):
        for item in node:
            found |= _env_names(item)
    return found


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses_and_sets_only_known_settings(path: Path) -> None:
    docs = _docs(path)
    assert docs, f"{path} is empty"
    unknown = set().union(*(_env_names(d) for d in docs)) - KNOWN
    assert not unknown, f"{path.name} sets variables the settings do not read: {sorted(unknown)}"


def test_kubernetes_objects_are_complete() -> None:
    kinds = {d["kind"]: d for p in DEPLOY.glob("k8s/*.yaml") for d in _docs(p)}  # type: ignore[index]
    assert {"ConfigMap", "Secret", "Job", "Deployment", "Service"} <= set(kinds)
    deployments = [
        d for p in DEPLOY.glob("k8s/*.yaml") for d in _docs(p) if d["kind"] == "Deployment"
    ]  # type: ignore[index]
    api = next(d for d in deployments if d["metadata"]["name"] == "outbox-api")  # type: ignore[index]
    container = api["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # tokens never in clear: the API serves HTTPS with its certificate
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    env = {e["name"] for e in container["env"]}
    assert {"OUTBOX_API_TLS_CERT", "OUTBOX_API_TLS_KEY"} <= env


def test_publisher_pods_have_probes_on_their_metrics_port() -> None:
    """The publisher's probes and /metrics are served by the process itself (app.probes) on
    OUTBOX_PUBLISHER_METRICS_PORT, bound to the pod's address, not loopback."""
    (doc,) = _docs(DEPLOY / "k8s" / "publisher-deployment.yaml")
    container = doc["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    env = {e["name"]: e.get("value") for e in container["env"]}
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    assert str(port["containerPort"]) == env["OUTBOX_PUBLISHER_METRICS_PORT"]
    assert env["OUTBOX_PUBLISHER_METRICS_HOST"] == "0.0.0.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_retention_runs_as_a_trickle_with_probes_everywhere() -> None:
    """Issue 47: retention keeps running (``purge --every``), not an hourly job deleting an
    hour of rows at once; its probes and /metrics on the pod's address, as the CLI parses them."""
    from app.cli import build_parser

    container = WORKLOADS["outbox-purge"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.every, args.metrics_host) == ("purge", 5.0, "0.0.0.0")
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    assert port["containerPort"] == args.metrics_port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert not [d for d in K8S_DOCS if d["kind"] == "CronJob"]
    unit = dict(_directives(DEPLOY / "systemd" / "outbox-purge.service"))
    argv = unit["ExecStart"].split()[1:]
    assert build_parser().parse_args(argv).every == 5.0 and unit["Restart"] == "always"
    assert not list((DEPLOY / "systemd").glob("outbox-purge.timer"))


@pytest.mark.parametrize("path", ENV_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_unit_and_env_files_use_known_settings(path: Path) -> None:
    names = set(re.findall(r"\bOUTBOX_[A-Z0-9_]+", path.read_text())) - LOCAL_ONLY
    assert names <= KNOWN, f"{path.name}: unknown {sorted(names - KNOWN)}"


def _subcommands(node: object) -> set[str]:
    """First word of every compose ``command`` and Kubernetes container ``args``."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("command", "args") and isinstance(value, list) and value:
                found.add(str(value[0]))
            found |= _subcommands(value)
    elif isinstance(node, list):
        for item in node:
            found |= _subcommands(item)
    return found


def test_deploy_commands_exist_in_the_cli() -> None:
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    used = set().union(*(_subcommands(d) for p in YAMLS for d in _docs(p)))
    for path in ENV_FILES:
        used |= set(re.findall(r"bin/outbox (\w+)", path.read_text()))
    assert {"migrate", "publish", "serve"} <= used
    assert used <= commands, f"deploy files run commands the CLI lacks: {sorted(used - commands)}"


# ---------------------------------------------------------------- Kubernetes pods

K8S_DOCS: list[Any] = [d for p in sorted(DEPLOY.glob("k8s/*.yaml")) for d in _docs(p)]
IMAGE_UID = 10001  # the Dockerfile's `useradd --uid` and `USER` (checked below)


def _workloads() -> dict[str, Any]:
    """Pod template of every Deployment, Job and CronJob, by workload name."""
    found = {}
    for doc in K8S_DOCS:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in ("Deployment", "Job"):
            found[name] = doc["spec"]["template"]
        elif kind == "CronJob":
            found[name] = doc["spec"]["jobTemplate"]["spec"]["template"]
    return found


WORKLOADS = _workloads()
#: The secrets each process reads; a pod mounts these keys of outbox-secrets and no other.
SECRETS_NEEDED = {
    # the API reads the database only (issue 48: it was given the broker URL it never used)
    "outbox-api": {"DATABASE_URL", "API_TOKEN", "OPERATOR_TOKEN", "METRICS_TOKEN"},
    "outbox-publisher": {"DATABASE_URL", "AMQP_URL"},
    "outbox-migrate": {"DATABASE_URL"},
    "outbox-purge": {"DATABASE_URL"},
}


def test_the_workloads_are_the_known_four() -> None:
    assert set(WORKLOADS) == set(SECRETS_NEEDED)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_container_runs_unprivileged_on_a_read_only_root(name: str) -> None:
    spec = WORKLOADS[name]["spec"]
    assert spec["automountServiceAccountToken"] is False
    pod = spec["securityContext"]
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in [*spec["containers"], *spec.get("initContainers", [])]:
        effective = {**pod, **container.get("securityContext", {})}  # the container's wins
        assert effective["runAsNonRoot"] is True
        assert effective["runAsUser"] == effective["runAsGroup"] == IMAGE_UID
        assert effective["allowPrivilegeEscalation"] is False
        assert effective.get("privileged", False) is False
        assert effective["readOnlyRootFilesystem"] is True
        assert effective["capabilities"] == {"drop": ["ALL"]}
        tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
        assert "emptyDir" in volumes[tmp["name"]]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_secrets_reach_pods_as_files_and_only_those_they_need(name: str) -> None:
    (container,) = WORKLOADS[name]["spec"]["containers"]
    assert not [s for s in container.get("envFrom", []) if "secretRef" in s]
    assert not [e for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
    volumes = {v["name"]: v for v in WORKLOADS[name]["spec"]["volumes"]}
    files = {}  # path in the container -> key of outbox-secrets
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret", {})
        if secret.get("secretName") == "outbox-secrets":
            assert mount["readOnly"] is True
            assert secret["defaultMode"] == 0o440  # group (fsGroup 10001) only
            files |= {f"{mount['mountPath']}/{i['path']}": i["key"] for i in secret["items"]}
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    wanted = {f"OUTBOX_{s}_FILE" for s in SECRETS_NEEDED[name]}
    assert {n for n in env if n.endswith("_FILE")} == wanted
    for variable in wanted:
        assert files[env[variable]] == variable.removesuffix("_FILE")
    assert set(files.values()) == {f"OUTBOX_{s}" for s in SECRETS_NEEDED[name]}
    (secret,) = [d for d in K8S_DOCS if d["kind"] == "Secret"]
    assert set(files.values()) <= set(secret["stringData"])


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _policies_for(name: str) -> list[dict[str, Any]]:
    labels = WORKLOADS[name]["metadata"]["labels"]
    return [
        d["spec"]
        for d in K8S_DOCS
        if d["kind"] == "NetworkPolicy" and _selects(d["spec"]["podSelector"], labels)
    ]


def _ports(policies: list[dict[str, Any]], direction: str) -> set[tuple[str, int]]:
    peers = "from" if direction == "ingress" else "to"
    found = set()
    for policy in policies:
        for rule in policy.get(direction, []):
            assert rule.get(peers), f"a {direction} rule open to every peer: {rule}"
            assert rule.get("ports"), f"a {direction} rule open on every port: {rule}"
            found |= {(p["protocol"], p["port"]) for p in rule["ports"]}
    return found


#: What each workload talks to: ingress (who reaches it) and egress (what it reaches).
DNS, POSTGRES, AMQP = {("UDP", 53), ("TCP", 53)}, {("TCP", 5432)}, {("TCP", 5672), ("TCP", 5671)}
TRAFFIC = {
    "outbox-api": ({("TCP", 8443)}, DNS | POSTGRES),
    "outbox-publisher": ({("TCP", 9600)}, DNS | POSTGRES | AMQP),
    "outbox-migrate": (set(), DNS | POSTGRES),
    "outbox-purge": ({("TCP", 9465)}, DNS | POSTGRES),
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_network_policies_isolate_each_pod_to_what_it_talks_to(name: str) -> None:
    policies = _policies_for(name)
    types = {t for p in policies for t in p["policyTypes"]}
    assert types == {"Ingress", "Egress"}, "isolated both ways"
    ingress, egress = TRAFFIC[name]
    assert _ports(policies, "ingress") == ingress
    assert _ports(policies, "egress") == egress
    (container,) = WORKLOADS[name]["spec"]["containers"]
    assert {("TCP", p["containerPort"]) for p in container.get("ports", [])} == ingress


PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


@pytest.mark.parametrize("name", ["outbox-api", "outbox-publisher", "outbox-purge"])
def test_prometheus_reaches_every_metrics_endpoint(name: str) -> None:
    """The API's /metrics (what the database knows), each publisher's own (what it did) and the
    purge's (its passes: OutboxPurgeStalled)."""
    (port,) = TRAFFIC[name][0]
    rules = [r for p in _policies_for(name) for r in p.get("ingress", [])]
    assert any(
        PROMETHEUS in r["from"] and {"protocol": port[0], "port": port[1]} in r["ports"]
        for r in rules
    ), rules


# ---------------------------------------------------------------- the image


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.partition(" ") for line in lines if line and line[0] != "#")
    ]


IMAGE_LOCK = REPO / "deploy" / "requirements-image.lock"


def _image_pins() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of deploy/requirements-image.lock."""
    text = IMAGE_LOCK.read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pin, *options = line.split()
        name, _, version = pin.partition("==")
        hashes = [o.removeprefix("--hash=sha256:") for o in options]
        assert version and all(o.startswith("--hash=sha256:") for o in options), line
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), line
        pins[canonicalize_name(name)] = (version, hashes)
    return pins


def test_the_image_installs_only_hashed_files_of_the_tested_versions() -> None:
    """Issue 48, Low 7: the lock had no hashes. The image installs from a lock whose every pin
    carries the SHA-256 of each of its files (``--require-hashes``), at the versions of
    requirements-dev.lock, and builds the project with no index and no other download."""
    steps = _dockerfile()
    copied = " ".join(args for op, args in steps if op == "COPY").split()
    assert "deploy/requirements-image.lock" in copied
    installs = [c.split() for op, args in steps if op == "RUN" for c in args.split("&&")]
    installs = [c for c in installs if c[:2] == ["pip", "install"]]
    assert len(installs) == 2, installs
    locked, package = installs
    assert {"--require-hashes", "--no-deps", "-r", "requirements-image.lock"} <= set(locked)
    assert package[-1] == "." and {"--no-deps", "--no-build-isolation"} <= set(package)
    pins = _image_pins()
    dev = {}
    for line in (REPO / "requirements-dev.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            dev[canonicalize_name(name)] = version.strip()
    for name, (version, _) in pins.items():
        if name not in ("pip", "setuptools", "wheel", "packaging"):
            assert dev.get(name) == version, (name, version, dev.get(name))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        assert canonicalize_name(Requirement(requirement).name) in pins, requirement
    assert {"pip", "setuptools", "wheel"} <= set(pins)


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    """Numeric, so Kubernetes' runAsNonRoot can verify it; the uid the manifests run as."""
    steps = _dockerfile()
    users = [args for op, args in steps if op == "USER"]
    assert users, "no USER: the image runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid == str(IMAGE_UID) and gid in ("", str(IMAGE_UID)), users[-1]
    run = " ".join(args for op, args in steps if op == "RUN")
    assert re.search(rf"useradd [^&]*--uid {IMAGE_UID}\b", run)
    assert re.search(rf"groupadd [^&]*--gid {IMAGE_UID}\b", run)


# ---------------------------------------------------------------- docker compose

COMPOSE = DEPLOY / "docker-compose.yml"
INIT_ROLES = DEPLOY / "postgres" / "init-roles.sh"
SECRET_NAME = re.compile(r"PASS|TOKEN|SECRET|_URL$|KEY$")


def test_compose_has_no_default_for_any_variable() -> None:
    """`${VAR:-outbox}` started a broker and a database with a guessable password when the
    variable was unset; every substitution now requires its variable."""
    uses = re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?+]?)([^}]*)\}", COMPOSE.read_text())
    assert uses, "no variable at all: the RabbitMQ password has to come from somewhere"
    for name, op, message in uses:
        assert op == ":?" and message.strip(), f"${{{name}{op}{message}}} must be ${{{name}:?…}}"


def test_compose_passes_secrets_as_files_to_the_images_that_read_them() -> None:
    (doc,) = _docs(COMPOSE)
    compose: dict[str, Any] = doc
    declared = compose["secrets"]
    for name, source in declared.items():  # host files under deploy/secrets/ (git-ignored)
        assert set(source) == {"file"} and source["file"].startswith("./secrets/"), name
    for service, spec in compose["services"].items():
        env = spec.get("environment", {})
        mounted = set(spec.get("secrets", []))
        assert mounted <= set(declared), service
        for variable, value in env.items():
            if variable.endswith("_FILE"):
                assert value.startswith("/run/secrets/"), (service, variable)
                assert value.removeprefix("/run/secrets/") in mounted, (service, variable)
            elif SECRET_NAME.search(variable) and variable != "OUTBOX_API_TLS_KEY":
                # only a password the image cannot read from a file, and only from a variable
                assert (service, variable) == ("rabbitmq", "RABBITMQ_DEFAULT_PASS"), variable
                assert str(value).startswith("${RABBITMQ_PASSWORD:?"), value
        wanted = {v.removeprefix("/run/secrets/") for k, v in env.items() if k.endswith("_FILE")}
        if service == "postgres":  # and the roles' passwords, which its init script reads
            wanted |= set(re.findall(r"\$\(secret (\w+)\)", INIT_ROLES.read_text()))
        assert mounted == wanted, f"{service} mounts secrets it does not read"
    outbox = {
        n: s["environment"]
        for n, s in compose["services"].items()
        if "outbox" in s.get("image", "")
    }
    assert {"OUTBOX_DATABASE_URL_FILE"} <= set(outbox["migrate"])
    assert {"OUTBOX_DATABASE_URL_FILE", "OUTBOX_AMQP_URL_FILE"} <= set(outbox["publisher"])
    assert {f"OUTBOX_{s}_FILE" for s in SECRETS_NEEDED["outbox-api"]} <= set(outbox["api"])
    assert compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"]


def test_secret_directories_are_git_ignored() -> None:
    ignored = (DEPLOY.parent / ".gitignore").read_text().split()
    assert {"deploy/secrets/", "deploy/tls/"} <= set(ignored)


# ---------------------------------------------------------------- systemd

UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
#: The sandbox every unit runs in (values as written; `CapabilityBoundingSet=` empty: none).
SANDBOX = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",  # CPython without a JIT: no W+X mapping (see the docs)
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "SystemCallFilter": "@system-service",
    "RestrictSUIDSGID": "yes",
}
#: The secrets each command reads, as in the Kubernetes pods.
COMMAND_SECRETS = {
    "serve": SECRETS_NEEDED["outbox-api"],
    "publish": SECRETS_NEEDED["outbox-publisher"],
    "migrate": SECRETS_NEEDED["outbox-migrate"],
    "purge": SECRETS_NEEDED["outbox-purge"],
}


def _directives(path: Path) -> list[tuple[str, str]]:
    """(key, value) of the [Service] section, in order (keys may repeat)."""
    found, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            found.append((key, value))
    return found


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_every_unit_runs_sandboxed_as_the_outbox_user(path: Path) -> None:
    service = dict(_directives(path))  # the last of a repeated key wins, as in systemd
    assert service["User"] == service["Group"] == "outbox"
    assert {key: service.get(key) for key in SANDBOX} == SANDBOX


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_every_unit_gets_its_secrets_as_credentials(path: Path) -> None:
    directives = _directives(path)
    (command,) = re.findall(r"bin/outbox (\w+)", dict(directives)["ExecStart"])
    credentials = dict(v.split(":", 1) for k, v in directives if k == "LoadCredential")
    env = dict(v.split("=", 1) for k, v in directives if k == "Environment")
    files = {name: value for name, value in env.items() if name.endswith("_FILE")}
    assert set(files) == {f"OUTBOX_{s}_FILE" for s in COMMAND_SECRETS[command]}
    for value in files.values():  # %d: the unit's $CREDENTIALS_DIRECTORY
        name = value.removeprefix("%d/")
        assert credentials[name] == f"/etc/outbox/credentials/{name}"
    assert len(credentials) == len(files), "a credential the command does not read"
    secrets = {f"OUTBOX_{s}" for s in COMMAND_SECRETS["serve"]}
    assert not secrets & set(env), "a secret in the unit itself"
    assert dict(directives)["EnvironmentFile"] == "/etc/outbox/outbox.env"


def test_the_environment_file_holds_no_secret() -> None:
    """Settings only: a secret both in outbox.env and as a credential is refused at start."""
    text = (DEPLOY / "systemd" / "outbox.env.example").read_text()
    assigned = set(re.findall(r"^(OUTBOX_[A-Z_]+)=", text, flags=re.M))
    assert assigned, "the example sets nothing"
    assert not assigned & {f"OUTBOX_{s}" for s in COMMAND_SECRETS["serve"]}


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_knows_every_directive(tmp_path: Path) -> None:
    """`systemd-analyze verify` on copies whose ExecStart is /bin/true (no install here)."""
    names = []
    for path in [*UNITS, *(DEPLOY / "systemd").glob("*.timer")]:
        name = path.name.replace("@.service", "@1.service")
        text = path.read_text().replace("/opt/outbox/.venv/bin/outbox", "/bin/true")
        (tmp_path / name).write_text(text)
        names.append(name)
    if "outbox-publisher@1.service" in names:  # verify loads the template of an instance
        (tmp_path / "outbox-publisher@.service").write_text(
            (tmp_path / "outbox-publisher@1.service").read_text()
        )
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(f"./{n}" for n in names)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr.strip()) == (0, "")


def test_the_api_behind_the_ingress_trusts_its_forwarded_addresses() -> None:
    """Issue 48, item 6: the k8s API sat behind the ingress with no
    ``OUTBOX_API_FORWARDED_ALLOW_IPS``: every audit row kept the ingress's address and all
    clients shared one throttle bucket."""
    (container,) = WORKLOADS["outbox-api"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env.get("OUTBOX_API_FORWARDED_ALLOW_IPS")
