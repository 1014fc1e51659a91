"""The "Per-architecture fields" tables of docs/checkpoint-format.md, written from the config classes.

    python tests/helpers/config_fields_doc.py     # prints the section; tests/format/test_config_docs.py
                                                  # checks the docs hold exactly this
"""

from __future__ import annotations

import importlib
import json

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from bestiary.core.format.config import PretrainedConfig
from bestiary.core.format.hf_config import DecoderConfig, MoEFields, WindowFields
from bestiary.registry import default_registry

BASES: tuple[type[BaseModel], ...] = (MoEFields, WindowFields, DecoderConfig)


def type_name(field: FieldInfo) -> str:
    """The field's annotation as the docs write it: `int or null`, `'a', 'b'` for a Literal."""
    a = field.annotation
    text = a.__name__ if isinstance(a, type) else str(a).replace("typing.", "")
    if text.startswith("Literal[") and text.endswith("]"):
        text = text[len("Literal["):-1]
    return text.replace("NoneType", "null").replace("None", "null").replace(" | ", " or ").replace("|", "\\|")


def own_fields(cls: type[BaseModel], base: type[BaseModel]) -> list[tuple[str, FieldInfo, FieldInfo | None]]:
    """(name, field, base's field) of what `cls` adds to `base` or sets otherwise (architecture aside)."""
    out = []
    for name, field in cls.model_fields.items():
        inherited = base.model_fields.get(name)
        if name != "architecture" and (inherited is None or inherited.default != field.default
                                       or inherited.annotation != field.annotation):
            out.append((name, field, inherited))
    return out


def table(rows: list[tuple[str, FieldInfo, FieldInfo | None]]) -> str:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field, inherited in rows:
        about = field.description or (inherited.description if inherited else "") or ""
        lines.append(f"| `{name}` | {type_name(field)} | `{json.dumps(field.default)}` | {about.replace('|', '/')} |")
    return "\n".join(lines)


def section() -> str:
    """The markdown of the section, from "### Per-architecture fields" to the JSON-schema paragraph."""
    parts = ["### Per-architecture fields", "",
             "Every built-in config class is a `DecoderConfig` (`bestiary.core.format.hf_config`), or one of its "
             "two extensions:", "", "**`DecoderConfig`**: `PretrainedConfig` + rotary, biases, tied lm_head", "",
             table(own_fields(DecoderConfig, PretrainedConfig)), "",
             "**`WindowFields`**: `DecoderConfig` + an attention window on some layers", "",
             table(own_fields(WindowFields, DecoderConfig)), "",
             "**`MoEFields`**: `WindowFields` + routed experts in every layer (`intermediate_size` is one "
             "expert's)", "", table(own_fields(MoEFields, WindowFields)), "",
             "Each narrows `architecture` to its own name and sets or adds these fields:", ""]
    specs = sorted(default_registry().specs.values(), key=lambda s: s.name)
    for spec in (s for s in specs if s.model_class.startswith("bestiary.models.")):
        module, _, name = spec.config_class.partition(":")
        cls = getattr(importlib.import_module(module), name)
        base = next(b for b in BASES if issubclass(cls, b))
        rows = own_fields(cls, base)
        parts += [f"**`{spec.name}`** (`{module}.{name}`, a `{base.__name__}`)", "",
                  table(rows) if rows else "Nothing of its own.", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(section())
