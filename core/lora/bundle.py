"""Adapters bundled in an engine dir by `bestiary build --lora_dir` (docs/checkpoint-format.md).

    config.json   "lora": {"max_lora_rank": R, "lora_target_modules": [...],
                           "adapters": [{"task_uid": "0", "name": ..., "file": "lora/0.safetensors",
                                         "modules": [...], "max_rank": r}, ...]}
    lora/<uid>.safetensors   "lora_weights" [M, W] (the engine's dtype), "lora_config" [M, 3] int32:
                             TensorRT-LLM's LoRA tensors (core.lora.trtllm_tensors), every rank's weights

Task uid i is the i-th --lora_dir; `LoraRequest(i)` (or `bestiary run --lora_task_uids i`) runs it,
the runtime reading it on first use like any adapter (core.lora.cache). Adapters given at run
time must keep to the same max_lora_rank and lora_target_modules.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError

LORA_DIR = "lora"


class BundledAdapter(BaseModel):
    """One adapter of an engine."""

    task_uid: str = Field(description="The task id requests give (the index of its --lora_dir).")
    name: str = Field(description="The adapter directory's name.")
    file: str = Field(description="Its TensorRT-LLM LoRA tensors, relative to the engine dir.")
    modules: list[str] = Field(description="The LoRA modules it adapts.")
    max_rank: int = Field(description="Its largest rank.")


class LoraBuildConfig(BaseModel):
    """config.json's "lora" section: the build's LoRA limits and the bundled adapters."""

    max_lora_rank: int = Field(description="No bundled adapter has a larger rank.")
    lora_target_modules: list[str] = Field(description="LoRA module names the bundled adapters may adapt.")
    adapters: list[BundledAdapter] = Field(default_factory=list)


def engine_lora(engine_dir: str | Path) -> LoraBuildConfig | None:
    """config.json's "lora" section of an engine dir (None: built without LoRA flags)."""
    config = Path(engine_dir) / "config.json"
    section = read_json(config).get("lora") if config.is_file() else None
    if not section:
        return None
    try:
        return LoraBuildConfig.model_validate(section)
    except ValueError as err:
        raise BestiaryError(f"{config}: lora: {str(err).splitlines()[0]}") from None


def bundled_adapters(engine_dir: str | Path) -> dict[str, Path]:
    """task uid -> TensorRT-LLM LoRA tensor file of the adapters an engine dir bundles (none: {})."""
    engine_dir = Path(engine_dir)
    lora = engine_lora(engine_dir)
    out = {}
    for adapter in lora.adapters if lora else ():
        path = engine_dir / adapter.file
        if not path.is_file():
            raise BestiaryError(f"{engine_dir / 'config.json'}: lora adapter {adapter.task_uid}: {path} not found")
        out[adapter.task_uid] = path
    return out
