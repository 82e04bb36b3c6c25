"""Alert rules and the dashboard: valid for Prometheus (promtool), unit-tested, and only using
metrics the product exports; every alert has a runbook section."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import cast

import pytest
import yaml
from prometheus_client.core import Metric

from app.api.metrics import SnapshotCollector
from app.cli.purgeprobes import PurgeCollector
from app.consumer import ConsumerMetrics
from app.consumer import registry_for as consumer_registry
from app.outbox.purging import PurgeLoop, PurgeSchedule
from app.outbox.read.metrics import MetricsSnapshot
from app.outbox.retention import Retention
from app.outbox.states import Status
from app.outbox.upkeep import Upkeep
from app.publisher.metrics import PublisherMetrics, registry_for

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "outbox-alerts.yml"
RULES_TEST = REPO / "deploy" / "prometheus" / "outbox-alerts-test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "outbox-dashboard.json"


UPKEEP = Upkeep(
    live_rows=0,
    dead_rows=0,
    table_bytes=0,
    index_bytes=0,
    last_vacuum_at=None,
    last_analyze_at=None,
    autovacuum_runs=0,
    vacuum_running=False,
    server_autovacuum=True,
    naptime_seconds=15.0,
)


def exported() -> set[str]:
    """Every sample name the API, a publisher and a consumer export."""
    names: set[str] = set()
    pub = PublisherMetrics()
    pub.gauges = lambda: {}
    families: list[Metric] = [
        *registry_for(pub, publisher_id="p").collect(),
        *consumer_registry(ConsumerMetrics(), consumer="c").collect(),
        *SnapshotCollector(
            MetricsSnapshot(
                counts={s: 0 for s in Status},
                oldest_pending_age_seconds=None,
                oldest_in_flight_age_seconds=None,
                possible_duplicates=0,
                operator_republished=0,
                publishers_alive=0,
                publishers_known=0,
                upkeep=UPKEEP,
            )
        ).collect(),
    ]
    families += PurgeCollector(_idle_purge_loop()).collect()
    for fam in families:
        names |= {s.name for s in fam.samples}
    return names


def _idle_purge_loop() -> PurgeLoop:
    """An ``outbox purge --every`` loop that has run no pass (its metrics exist from the start)."""
    schedule = PurgeSchedule(
        older_than=dt.timedelta(days=7),
        inbox_older_than=dt.timedelta(days=7),
        every=5.0,
        audit_every=3600.0,
        chunk=1000,
        sleep_coef=0.0,
        actor="retention",
    )
    return PurgeLoop(
        cast(Retention, None),  # never called: no pass runs
        schedule,
        inbox=lambda _older, _chunk: 0,
        on_audit=lambda _doc: None,
        on_failure=lambda _why: None,
    )


def metric_names(expr: str) -> set[str]:
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"', "", expr)))
    return {w for w in words if w.startswith("outbox_")}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: `make tools` installs Debian's prometheus package")
    return path


def test_the_rules_are_valid_and_their_unit_tests_pass() -> None:
    tool = _promtool()
    check = subprocess.run(
        [tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [tool, "test", "rules", str(RULES_TEST)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULES.parent,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_alerts_and_dashboard_use_only_exported_metrics() -> None:
    known = exported()
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    exprs = [r["expr"] for r in rules]
    dashboard = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for expr in exprs:
        unknown = metric_names(expr) - known
        assert not unknown, f"{expr!r} uses metrics nothing exports: {sorted(unknown)}"


def test_every_alert_has_a_runbook_section() -> None:
    runbook = (REPO / "docs" / "operations.md").read_text()
    for rule in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]:
        assert f"### {rule['alert']}" in runbook, rule["alert"]
        assert rule["annotations"]["runbook"].endswith("#" + rule["alert"].lower())
