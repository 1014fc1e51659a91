"""An HF PEFT adapter_config.json, as PEFT's LoraConfig reads it (the fields inference needs).

Scaling of the adapter on module path m (PEFT's `get_pattern_key`: the first pattern p with
m matching `(.*\\.)?p$`):

    r_m = rank_pattern[p] or r,   alpha_m = alpha_pattern[p] or lora_alpha
    s_m = alpha_m / sqrt(r_m) with use_rslora, else alpha_m / r_m,   y = W x + s_m B (A x)

Anything that changes that formula (DoRA, a trained bias, modules_to_save copies, other PEFT
methods, ...) is refused with a one-line error naming the file and the key.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bestiary.core.format.errors import BestiaryError

CONFIG_NAME = "adapter_config.json"

# key -> why a truthy value is refused (PEFT features that are not W + s B A).
REFUSED: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed) adapters are not supported",
    "modules_to_save": "fully trained module copies (modules_to_save) are not supported",
    "lora_bias": "adapters with a trained lora_B bias are not supported",
    "fan_in_fan_out": "Conv1D (fan_in_fan_out) adapters are not supported",
    "target_parameters": "adapters on raw parameters (target_parameters) are not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QALoRA adapters are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "megatron_config": "Megatron parallel adapters are not supported",
}


class PeftLoraConfig(BaseModel):
    """The fields of a PEFT LoRA adapter_config.json that decide the adapter's math."""

    model_config = ConfigDict(extra="allow")

    peft_type: str = Field("LORA", description="PEFT method; only LORA is supported")
    r: int = Field(8, gt=0, description="default rank")
    lora_alpha: float = Field(8, description="default alpha: scaling = alpha / r (or / sqrt(r) with rslora)")
    use_rslora: bool = Field(False, description="scaling alpha / sqrt(r) instead of alpha / r")
    target_modules: list[str] | str | None = Field(None, description="module names (suffix match) or one regex")
    exclude_modules: list[str] | str | None = Field(None, description="modules left out (same matching)")
    rank_pattern: dict[str, int] = Field(default_factory=dict, description="module pattern -> rank")
    alpha_pattern: dict[str, float] = Field(default_factory=dict, description="module pattern -> alpha")
    bias: str = Field("none", description="trained biases: only 'none' is supported")
    base_model_name_or_path: str | None = None

    def pattern_key(self, patterns: dict, module: str) -> str | None:
        """PEFT's get_pattern_key: the first pattern p with `module` matching `(.*\\.)?p$`."""
        return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", module)), None)

    def rank_of(self, module: str) -> int:
        key = self.pattern_key(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def scaling_of(self, module: str) -> float:
        """s_m of the module docstring for HF module path `module` (no `base_model.model.` prefix)."""
        key = self.pattern_key(self.alpha_pattern, module)
        alpha = self.alpha_pattern[key] if key is not None else self.lora_alpha
        r = self.rank_of(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str) -> bool:
        """PEFT's check_target_module_exists: is HF module path `module` adapted?"""
        if self.exclude_modules and _matches(self.exclude_modules, module):
            return False
        return self.target_modules is not None and _matches(self.target_modules, module)


def _matches(spec: list[str] | str, module: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, module) is not None
    return module in spec or any(module.endswith(f".{t}") for t in spec)


def read_peft_config(directory: Path) -> PeftLoraConfig:
    """adapter_config.json of `directory`, with every unsupported feature refused (one line each)."""
    from bestiary.core.format.config import read_json

    path = directory / CONFIG_NAME
    if not path.is_file():
        raise BestiaryError(f"{directory}: no {CONFIG_NAME} (expected an HF PEFT LoRA adapter directory)")
    data: dict[str, Any] = read_json(path)
    peft_type = str(data.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise BestiaryError(f"{path}: peft_type {data.get('peft_type')!r} is not supported; expected LORA")
    for key, why in REFUSED.items():
        if data.get(key):
            raise BestiaryError(f"{path}: {key} = {data[key]!r}: {why}")
    try:
        config = PeftLoraConfig.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BestiaryError(f"{path}: {where}: {first['msg']}") from None
    if config.bias != "none":
        raise BestiaryError(f"{path}: bias = {config.bias!r}: trained biases are not supported; expected 'none'")
    return config
