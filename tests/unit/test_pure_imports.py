"""The pure modules stay pure: importing one loads no database stack, no driver and no event loop.

They hold the publisher's decisions (confirm tracking, settlement, holdings, envelopes,
destinations), the row rules every writer shares and the consumer's ack order; they are tested
without services and run in Spark executors. One import of the outbox's store or of a heavy package
``__init__`` used to pull in 700 modules, SQLAlchemy and asyncio among them, for a named tuple.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PURE = [
    "app.confirms",
    "app.histogram",
    "app.rates",
    "app.outbox.content",
    "app.outbox.read.cursors",
    "app.outbox.read.figures",
    "app.outbox.records",
    "app.outbox.scope",
    "app.outbox.states",
    "app.outbox.upkeep",
    "app.amqp.codec",
    "app.amqp.errors",
    "app.publisher.destinations",
    "app.publisher.nackruns",
    "app.publisher.envelope",
    "app.publisher.holdings",
    "app.publisher.outcomes",
    "app.publisher.settlement",
    "app.publisher.unreachable",
    "app.consumer.acks",
    "app.consumer.config",
    "app.consumer.core",
    "app.consumer.held",
]
#: What a pure module must not load (pamqp is a frame codec without I/O: allowed).
HEAVY = ("sqlalchemy", "psycopg", "asyncio", "aio_pika", "aiormq", "fastapi", "pydantic")


def loaded_by(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", PURE)
def test_a_pure_module_loads_no_io_stack(module: str) -> None:
    heavy = sorted(m for m in loaded_by(module) if m.split(".")[0] in HEAVY)
    assert not {m.split(".")[0] for m in heavy}, f"{module} loads {heavy[:8]}"


def test_the_check_sees_a_heavy_import() -> None:
    assert "sqlalchemy" in loaded_by("app.outbox.store")


#: The API modules the CLI may import: the response models (its ``--json`` output is the REST
#: answer's shape) and the app factory (``outbox api``). A router module is the HTTP layer.
CLI_MAY_USE = {"app.api", "app.api.models"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_cli_takes_models_not_routers_from_the_api() -> None:
    cli = Path(__file__).resolve().parents[2] / "app" / "cli"
    used = {
        (f.name, m)
        for f in sorted(cli.glob("*.py"))
        for m in _imports(f)
        if m.startswith("app.api") and m not in CLI_MAY_USE
    }
    assert not used, f"the CLI imports API router modules: {sorted(used)}"
