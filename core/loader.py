"""The weights loader: translate canonical names, load rank slices lazily, postprocess, strictly.

1. translate: a canonical key is mapped section by section (split on ".") through a key
   map; a list value fans out (qkv -> [q_proj, k_proj, v_proj]), None drops the section.
   Map priority: customized_key_dict > the layer map matching the module path >
   the architecture's map > DEFAULT_KEY_MAP.
2. load: each source key's slice for (tp_size, tp_dim, tp_rank), from the source.
3. postprocess: the hook matching the key (glob) turns the slices into target tensor(s).
4. strict: every target filled, every source tensor used, every shape checked.
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from bestiary.core.errors import WeightsError
from bestiary.core.postprocess import identity
from bestiary.core.sources.base import WeightSource
from bestiary.registry.spec import ArchitectureSpec, resolve

# The TensorRT-LLM loader's default: canonical section -> HF LLaMA section.
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


@dataclass(frozen=True)
class Target:
    """One tensor a rank's model holds: canonical key, local shape, dtype, slicing dim."""

    key: str
    module_path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int


def model_targets(model: nn.Module) -> list[Target]:
    """Every parameter and persistent buffer of `model` (built on the meta device) as a Target."""
    targets = []
    for path, module in model.named_modules():
        tp_dim_fn = getattr(module, "tp_dim", None)
        persistent = set(module.state_dict(keep_vars=True).keys()) if module._buffers else set()
        tensors = list(module.named_parameters(recurse=False))
        tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if n in persistent]
        for name, tensor in tensors:
            key = f"{path}.{name}" if path else name
            tp_dim = tp_dim_fn(name) if callable(tp_dim_fn) else -1
            targets.append(Target(key, path, tuple(tensor.shape), tensor.dtype, tp_dim))
    return targets


def nearest(name: str, candidates: list[str], n: int = 3) -> str:
    """' (nearest: a, b)' listing the candidates closest to `name`, or ''."""
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    return f" (nearest: {', '.join(close)})" if close else ""


class WeightsLoader:
    """Fills the targets of a model from a WeightSource through an architecture's key maps."""

    def __init__(
        self,
        source: WeightSource,
        spec: ArchitectureSpec,
        config,
        customized_key_dict: dict | None = None,
        label: str = "",
    ) -> None:
        self.source = source
        self.spec = spec
        self.config = config
        self.customized = dict(customized_key_dict or {})
        self.label = label
        self._source_keys = set(source.keys())
        self._hooks = {pattern: resolve(ref) for pattern, ref in spec.postprocess.items()}
        self.used: set[str] = set()

    # --- 1. translate ------------------------------------------------------------------
    def key_map_for(self, module_path: str) -> dict:
        """Default map < architecture map < matching layer maps < customized_key_dict."""
        merged = dict(DEFAULT_KEY_MAP)
        merged.update(self.spec.key_map)
        for pattern, layer_map in self.spec.layer_key_maps.items():
            if fnmatch.fnmatchcase(module_path, pattern):
                merged.update(layer_map)
        merged.update(self.customized)
        return merged

    def translate(self, key: str, module_path: str, layer_offset: int = 0) -> list[str]:
        """Source key(s) of canonical `key`; `layers.N` becomes `layers.(N + layer_offset)`."""
        key_map = self.key_map_for(module_path)
        options: list[list[str]] = []
        sections = key.split(".")
        for i, section in enumerate(sections):
            if section.isdigit() and i > 0 and sections[i - 1] == "layers":
                options.append([str(int(section) + layer_offset)])
                continue
            mapped = key_map.get(section, section)
            if mapped is None:
                continue
            options.append(list(mapped) if isinstance(mapped, (list, tuple)) else [mapped])
        return [".".join(p for p in parts if p) for parts in itertools.product(*options)]

    # --- plan: checks before any weight is read ----------------------------------------
    def plan(self, targets: list[Target], layer_offset: int, aliases: dict[str, str]) -> dict[str, list[str]]:
        """canonical key -> source keys for one rank; a missing source key is an error."""
        by_key = {t.key: t for t in targets}
        plan: dict[str, list[str]] = {}
        for target in targets:
            origin = by_key.get(aliases.get(target.key, target.key), target)
            sources = self.translate(origin.key, origin.module_path, layer_offset)
            missing = [s for s in sources if s not in self._source_keys]
            if missing:
                raise WeightsError(
                    f"{self.label}: tensor {missing[0]!r} (for {target.key!r}) not found in the source"
                    f"{nearest(missing[0], sorted(self._source_keys))}"
                )
            plan[target.key] = sources
            self.used.update(sources)
        return plan

    def check_all_used(self, target_keys: list[str]) -> None:
        """Every source tensor must be consumed by some target (after all ranks were planned)."""
        unused = sorted(self._source_keys - self.used)
        if unused:
            raise WeightsError(
                f"{self.label}: source tensor {unused[0]!r} is not used by any {self.spec.name} weight"
                f"{nearest(unused[0], target_keys)}" + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
            )

    # --- 2 + 3. load and postprocess -----------------------------------------------------
    def hook_for(self, key: str):
        """The postprocess hook whose glob matches `key` (first match), or identity."""
        for pattern, fn in self._hooks.items():
            if fnmatch.fnmatchcase(key, pattern):
                return fn
        return identity

    def load(self, target: Target, sources: list[str], tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
        """Target tensor(s) for one canonical key, cast to the target dtype, shapes checked."""
        try:
            tensors = [self.source.load(s, tp_size, target.tp_dim, tp_rank) for s in sources]
        except ValueError as err:  # a dim that does not split: the source shape is wrong
            raise WeightsError(f"{self.source.file_of(sources[0])}: {sources[0]!r} for {target.key!r}: {err}") from None
        try:
            out = self.hook_for(target.key)(target.key, tensors, self.config)
        except WeightsError:
            raise
        except (ValueError, RuntimeError) as err:
            raise WeightsError(f"{self.source.file_of(sources[0])}: postprocess of {target.key!r} failed: {err}") from None
        result = {}
        for key, tensor in out.items():
            if key == target.key and tuple(tensor.shape) != target.shape:
                raise WeightsError(
                    f"{self.source.file_of(sources[0])}: tensor {sources[0]!r} for {key!r} has shape "
                    f"{tuple(tensor.shape)} (from source shape {self.source.shape(sources[0])}), "
                    f"expected {target.shape}"
                )
            result[key] = tensor.to(target.dtype).contiguous()
        return result
