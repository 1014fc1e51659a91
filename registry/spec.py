"""What an architecture plugin registers: an `ArchitectureSpec`.

Code is referenced lazily as "module:attribute" strings so that listing architectures
(`bestiary list`, `bestiary --help`) imports no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

KeyMap = dict[str, "str | list[str] | None"]


def resolve(ref: str) -> Any:
    """Import "package.module:attr" and return attr. Import errors propagate with their real cause."""
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"lazy reference {ref!r} must look like 'package.module:attribute'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"lazy reference {ref!r}: module {module_name} has no attribute {attr!r}") from None


@dataclass(frozen=True)
class Supports:
    """Capabilities an architecture declares, so bad combinations are refused before reading weights."""

    quant_algos: tuple[str, ...] = ()
    kv_cache_quant_algos: tuple[str, ...] = ()
    lora_modules: tuple[str, ...] = ()
    tensor_parallel: bool = True
    pipeline_parallel: bool = True

    def summary(self) -> str:
        """Short human-readable list, for `bestiary list`."""
        parts = []
        if self.tensor_parallel:
            parts.append("TP")
        if self.pipeline_parallel:
            parts.append("PP")
        if self.quant_algos:
            parts.append("quant: " + ",".join(self.quant_algos))
        if self.kv_cache_quant_algos:
            parts.append("kv: " + ",".join(self.kv_cache_quant_algos))
        if self.lora_modules:
            parts.append("LoRA")
        return " ".join(parts) or "-"


@dataclass(frozen=True)
class ArchitectureSpec:
    """One architecture, as registered by its plugin.

    name: canonical architecture name written to config.json (e.g. "LlamaForCausalLM").
    hf_architectures / hf_model_types: HF config.json `architectures` / `model_type` it claims.
    gguf_architectures: GGUF `general.architecture` values it claims.
    config_class: "module:Class", a `PretrainedConfig` subclass.
    model_class: "module:Class", an `nn.Module` built as `Class(config, rank)`.
    from_hf_config: "module:function", `(hf_config: dict, dtype: str, mapping: Mapping) -> config`.
    key_map: canonical name section -> source section(s); overrides the loader's default map.
      A list fans out (qkv -> [q_proj, k_proj, v_proj]); None means "this section has no
      counterpart" and is dropped from the source name. A callable value
      `(config) -> str | list[str] | None` is evaluated with the model config (a fan-out
      whose length the config decides, e.g. one source tensor per MoE expert).
    source_key_maps: HF model_type of the source -> key map overriding `key_map` for such
      sources (one architecture read from two namings, e.g. THUDM chatglm and HF glm).
    layer_key_maps: glob over canonical module paths -> key map overriding `key_map` there.
    postprocess: glob over canonical tensor keys -> "module:function" with signature
      `(key: str, tensors: list[Tensor], config) -> dict[str, Tensor]`.
    ignored_source_keys: globs over source keys that no weight consumes on purpose (e.g.
      rotary `inv_freq` buffers saved by the reference code); every other source key must be used.
    """

    name: str
    config_class: str
    model_class: str
    from_hf_config: str
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    key_map: dict[str, Any] = field(default_factory=dict)
    source_key_maps: dict[str, dict[str, Any]] = field(default_factory=dict)
    layer_key_maps: dict[str, dict[str, Any]] = field(default_factory=dict)
    postprocess: dict[str, str] = field(default_factory=dict)
    ignored_source_keys: tuple[str, ...] = ()
    description: str = ""
    supports: Supports = field(default_factory=Supports)
    package: str = ""  # filled in by the registry: the distribution that registered it
