"""What an architecture plugin registers: an `ArchitectureSpec`.

Code is referenced lazily as "module:attribute" strings so that listing architectures
(`bestiary list`, `bestiary --help`) imports no torch.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bestiary.core.format.errors import PluginError

KeyMap = dict[str, "str | list[str] | None"]

# The TensorRT-LLM loader's default: canonical section -> HF LLaMA section (data, so plugins extend it
# without importing the loader and torch).
DEFAULT_KEY_MAP: dict[str, str | list[str] | None] = {
    "transformer": "model",
    "vocab_embedding": "embed_tokens",
    "lm_head": "lm_head",
    "ln_f": "norm",
    "attention": "self_attn",
    "qkv": ["q_proj", "k_proj", "v_proj"],
    "dense": "o_proj",
    "gate": "up_proj",
    "proj": "down_proj",
    "fc": "gate_proj",
    "input_layernorm": "input_layernorm",
    "post_layernorm": "post_attention_layernorm",
}


def resolve(ref: str) -> Any:
    """Import "package.module:attr" and return attr.

    A reference that names no module or attribute is a one-line PluginError; an import error
    inside the named module propagates with its real cause."""
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise PluginError(f"lazy reference {ref!r} must look like 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise
        raise PluginError(f"lazy reference {ref!r}: no module named {err.name!r}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"lazy reference {ref!r}: module {module_name} has no attribute {attr!r}") from None


def check_reference(ref: str) -> None:
    """Check "package.module:attr" without importing the module (so `bestiary list` stays light).

    The module must be findable (importlib.util.find_spec imports only its parent packages) and,
    when its source is at hand, bind `attr` (def, class, assignment or import);
    a module with a `__getattr__` or a star import is taken on trust. PluginError otherwise."""
    module_name, _, attr = ref.partition(":")
    if not attr or not module_name or not attr.isidentifier():
        raise PluginError(f"lazy reference {ref!r} must look like 'package.module:attribute'")
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise PluginError(f"lazy reference {ref!r}: no module named {module_name!r}")
    names = _top_level_names(found.origin) if found.origin and found.origin.endswith(".py") else None
    if names is not None and attr not in names and "__getattr__" not in names and "*" not in names:
        raise PluginError(f"lazy reference {ref!r}: module {module_name} has no attribute {attr!r}")


def _top_level_names(path: str) -> set[str] | None:
    """Names a module's source binds anywhere (None when it cannot be read or parsed)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


class HasExperts(Protocol):
    """A config with routed experts (core.format.hf_config.MoEFields and its subclasses)."""

    @property
    def num_local_experts(self) -> int: ...


@dataclass(frozen=True)
class PerExpert:
    """Key-map value: one canonical section -> `experts.{e}.{name}` for e in 0..E-1, E = the config's
    num_local_experts (the loader stacks the E sources with core.layers.moe.stack_experts)."""

    name: str

    def __call__(self, config: HasExperts) -> list[str]:
        """The E source names of this section, one per expert of `config`."""
        return [f"experts.{e}.{self.name}" for e in range(config.num_local_experts)]


@dataclass(frozen=True)
class LoraTargets:
    """How HF PEFT adapter modules land on an architecture's layers (data, read by core.lora).

    hf_modules: HF module name (the last part of a PEFT module path, e.g. "q_proj") -> the
      TensorRT-LLM LoRA module name(s) it feeds (core.lora.modules.MODULE_IDS). A tuple fans one
      fused HF module out: its lora_B rows go to each named module through that module's
      canonical weight postprocess (e.g. ChatGLM2's dense_h_to_4h -> ("mlp_h_to_4h", "mlp_gate")).
    hf_layers: HF paths of the decoder layer list ("model.layers"); an adapter whose modules
      sit elsewhere was made for another architecture.
    """

    hf_modules: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
    hf_layers: tuple[str, ...] = ("model.layers",)

    @property
    def modules(self) -> tuple[str, ...]:
        """Every LoRA module name an HF module feeds, in first-seen order."""
        out: list[str] = []
        for value in self.hf_modules.values():
            out += [v for v in ((value,) if isinstance(value, str) else value) if v not in out]
        return tuple(out)


@dataclass(frozen=True)
class Supports:
    """Capabilities an architecture declares, so bad combinations are refused before reading weights.

    quant_algos / kv_cache_quant_algos: the QuantAlgo / KVCacheQuantAlgo values it takes; empty means
    every one bestiary implements. kv_cache_quantization False: none (a cache that is not K / V of the
    usual kind, e.g. multi-head latent attention's latent rows). registry.capabilities checks a convert
    against them.
    """

    quant_algos: tuple[str, ...] = ()
    kv_cache_quant_algos: tuple[str, ...] = ()
    kv_cache_quantization: bool = True
    lora_modules: tuple[str, ...] = ()  # TensorRT-LLM LoRA module names (attn_q, mlp_gate, ...): see `lora`
    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    expert_parallel: bool = False  # MoE experts spread over ranks (mapping moe_ep_size; core.layers.moe)

    def summary(self) -> str:
        """Short human-readable list, for `bestiary list`."""
        parts = []
        if self.tensor_parallel:
            parts.append("TP")
        if self.pipeline_parallel:
            parts.append("PP")
        if self.expert_parallel:
            parts.append("EP")
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
    lora: which HF PEFT modules map to which LoRA modules (`supports.lora_modules` lists them).
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
    lora: LoraTargets = field(default_factory=LoraTargets)
    package: str = ""  # filled in by the registry: the distribution that registered it

    def references(self) -> dict[str, str]:
        """Every lazy "module:attr" reference of the spec, by the field that holds it."""
        refs = {"config_class": self.config_class, "model_class": self.model_class,
                "from_hf_config": self.from_hf_config}
        refs.update({f"postprocess[{pattern!r}]": ref for pattern, ref in self.postprocess.items()})
        return refs
