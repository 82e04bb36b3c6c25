"""The deploy files parse, and every OUTBOX_* variable they set is one the settings read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from app.cli import build_parser
from app.settings import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
YAMLS = sorted([*DEPLOY.glob("*.yml"), *DEPLOY.glob("k8s/*.yaml")])
ENV_FILES = sorted([*DEPLOY.glob("systemd/*"), DEPLOY / "Dockerfile"])
KNOWN = {f"OUTBOX_{name.upper()}" for name in Settings.model_fields}
# Variables the deploy scripts read themselves (not the service's settings).
LOCAL_ONLY = {"OUTBOX_LOCAL_DIR", "OUTBOX_LOCAL_AMQP_PORT", "OUTBOX_LOCAL_PG_PORT",
              "OUTBOX_LOCAL_RABBIT_NODE", "OUTBOX_PG_BIN", "OUTBOX_KEEP"}  # fmt: skip


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
