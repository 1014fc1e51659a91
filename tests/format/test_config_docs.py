"""docs/checkpoint-format.md's per-architecture field tables are the config classes' fields (written by
tests/helpers/config_fields_doc.py; rerun it after changing a config class)."""

from pathlib import Path

from config_fields_doc import section

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoint-format.md"


def test_field_tables_are_the_config_classes():
    text = DOC.read_text()
    shown = text[text.index("### Per-architecture fields"):text.index("The JSON schema of any config class")]
    assert shown.strip() == section().strip(), "rerun: python tests/helpers/config_fields_doc.py"
