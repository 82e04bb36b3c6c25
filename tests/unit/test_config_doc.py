"""docs/configuration.md is the rendering of the Settings class: no setting goes undocumented."""

from pathlib import Path

from app.config_doc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_current() -> None:
    assert DOC.read_text() == render(), "run: python -m app.config_doc > docs/configuration.md"


def test_every_field_has_a_description() -> None:
    from app.settings import Settings

    missing = [name for name, f in Settings.model_fields.items() if not f.description]
    assert not missing, f"settings without a description: {missing}"
