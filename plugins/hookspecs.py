"""Hook specifications of bestiary's plugin system (pluggy project name "bestiary").

An architecture package exposes a module (named in the `bestiary.architectures`
entry-point group) with functions decorated by `bestiary.plugins.hookimpl`.
Built-in architectures use exactly this API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "bestiary"
ENTRY_POINT_GROUP = "bestiary.architectures"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def bestiary_register_architectures(register: Callable[[Any], None]) -> None:
    """Register architectures: call `register(spec)` once per `ArchitectureSpec`.

    (Typed `Any` here: ArchitectureSpec lives a layer above, in bestiary.registry; `register`
    checks it at run time and raises TypeError for anything else.)

    The registry raises on a duplicate name, naming both packages.
    """


@hookspec
def bestiary_claim_hf_config(hf_config: dict[str, Any]) -> str | None:
    """Return the architecture name that handles this HF config.json dict, or None.

    Used when the HF architecture name / model_type is ambiguous (e.g. ChatGLM v1 and
    v2 both say "ChatGLMModel"). Two plugins claiming one config is an error naming both.
    """
