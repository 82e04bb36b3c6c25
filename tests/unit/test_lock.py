"""The lock file and pyproject.toml agree: every dependency pyproject names (with its extras)
is pinned in requirements-dev.lock to a version its specifier admits. A dependency changed
without `make lock` fails here, not on a fresh machine."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements-dev.lock").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra if not r.startswith(project["name"])]
    return reqs


def test_every_dependency_is_pinned_within_its_specifier() -> None:
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements-dev.lock: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{req.name}=={pins[name]} in the lock does not satisfy {req}: run `make lock`"
        )


def test_the_makefile_installs_from_the_lock() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"pip install -q -c \$\(LOCK\) -e '\.\[dev\]'", makefile)


@pytest.mark.parametrize("target", ["$(VENV)/.installed", "$(VENV_OLDEST)/.installed"])
def test_every_virtualenv_upgrades_setuptools(target: str) -> None:
    """`python -m venv` seeds the setuptools bundled with its Python (65.5 on 3.11, known CVEs);
    the lock cannot pin it (pip freeze leaves it out), so each venv recipe upgrades it first."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index(f"\n{target}:") :].split("\n\n")[0]
    lines = [line.strip() for line in recipe.splitlines()]
    upgrade = next(i for i, line in enumerate(lines) if "--upgrade pip setuptools" in line)
    install = next(i for i, line in enumerate(lines) if "-e '.[dev]'" in line)
    assert upgrade < install, recipe
