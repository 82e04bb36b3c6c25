"""Write deploy/requirements-image.lock: what the image installs, each pin with the SHA-256 of
every file PyPI holds for it, so that ``pip install --require-hashes`` refuses a file that
changed after the lock (a replaced release, a compromised mirror).

The set is what ``pip install .`` resolves under requirements-dev.lock (the versions the suite
ran with), plus the build tools the image uses (pip, setuptools, wheel, packaging) at the
versions of the development virtualenv (PyPI's latest for one it lacks). Every file of a release
is hashed, not only this machine's wheel, so the lock also holds on another architecture. Run by
``make lock``; needs pypi.org.

    python deploy/image_lock.py [--check]

``--check`` verifies the lock against the resolution without writing it (exit 1 if it differs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "deploy" / "requirements-image.lock"
DEV_LOCK = REPO / "requirements-dev.lock"
BUILD_TOOLS = ("pip", "setuptools", "wheel", "packaging")  # packaging: wheel needs it
HEADER = """\
# What deploy/Dockerfile installs, with the SHA-256 of every file PyPI holds for each pin:
# `pip install --require-hashes` refuses any other file. Written by `make lock`
# (deploy/image_lock.py) from requirements-dev.lock's versions; do not edit by hand.
"""


def resolved() -> list[tuple[str, str]]:
    """(name, version) of every package ``pip install .`` installs under the dev lock, and the
    build tools at the versions this interpreter has."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--report", str(report), "-c", str(DEV_LOCK), str(REPO)],
            check=True,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        found = json.loads(report.read_text())["install"]
    own = "outbox-sink"
    pins = {
        (i["metadata"]["name"], i["metadata"]["version"])
        for i in found
        if i["metadata"]["name"] != own
    }
    pins |= {(tool, _tool_version(tool)) for tool in BUILD_TOOLS}
    return sorted(pins, key=lambda p: p[0].lower())


def _tool_version(tool: str) -> str:
    """The version this interpreter has, else PyPI's latest (``wheel``: setuptools builds
    without it, but the project's build-system names it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(tool)
    except PackageNotFoundError:
        url = f"https://pypi.org/pypi/{tool}/json"
        with urllib.request.urlopen(url, timeout=60) as answer:
            return str(json.load(answer)["info"]["version"])


def hashes(name: str, version: str) -> list[str]:
    """SHA-256 of every file of ``name`` ``version`` on PyPI."""
    url = f"https://pypi.org/pypi/{name}/json"  # every release (the per-version page may 404)
    with urllib.request.urlopen(url, timeout=60) as answer:
        files = json.load(answer)["releases"].get(version, [])
    found = sorted({f["digests"]["sha256"] for f in files})
    if not found:
        raise SystemExit(f"{name}=={version}: PyPI lists no file")
    return found


def render(pins: list[tuple[str, str]]) -> str:
    lines = [HEADER]
    for name, version in pins:
        digests = hashes(name, version)
        cont = " \\"
        lines.append(f"{name}=={version}{cont}\n")
        lines += [
            f"    --hash=sha256:{d}{cont if i < len(digests) - 1 else ''}\n"
            for i, d in enumerate(digests)
        ]
    return "".join(lines)


def main(argv: list[str]) -> int:
    text = render(resolved())
    if "--check" in argv:
        if LOCK.read_text() != text:
            print(f"{LOCK.relative_to(REPO)} differs from the resolution: run `make lock`")
            return 1
        return 0
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
