"""Every setting does something: a ``Settings`` field that no product code reads is a knob that
lies to its operator (``OUTBOX_MAX_ATTEMPTS`` was one: documented, configured in Kubernetes, read
by nothing)."""

from __future__ import annotations

import ast
from pathlib import Path

from app.settings import SECRET_FILES, Settings

ROOT = Path(__file__).resolve().parents[2]
#: Where settings are declared or merely listed, not used.
NOT_READERS = {ROOT / "app" / "settings.py", ROOT / "app" / "config_doc.py"}


def _names_read() -> set[str]:
    """Attribute names read anywhere in the product, plus string constants (``getattr``, keys)."""
    names: set[str] = set()
    for path in sorted((ROOT / "app").rglob("*.py")):
        if path in NOT_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def test_every_setting_is_read_by_the_product() -> None:
    # ``<secret>_file`` fields are consumed by Settings itself: it reads the file into <secret>
    read = _names_read() | {f"{name}_file" for name in SECRET_FILES}
    unread = sorted(name for name in Settings.model_fields if name not in read)
    assert unread == [], f"settings read by nothing (use them or delete them): {unread}"


def test_the_check_would_catch_an_unread_setting() -> None:
    assert "max_attempts" not in Settings.model_fields
    assert "a_knob_nobody_reads" not in _names_read()
