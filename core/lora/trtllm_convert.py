"""HF PEFT adapter dirs <-> TensorRT-LLM's LoRA tensors (core.lora.trtllm_tensors), both ways.

PEFT -> TensorRT-LLM (hf_lora_convert.py's step): every adapted HF module of layer i becomes one row
(module_id, i, r) with A = lora_A [r, in] and B = s * lora_B [out, r], rows sorted by (layer,
module id). An HF module that feeds two LoRA modules (ChatGLM2's fused dense_h_to_4h) or one
MoE expert has no row of its own in that format and is refused.

TensorRT-LLM -> PEFT: each row becomes `<layers>.<i>.<parent>.<hf module>.lora_{A,B}.weight` with
rank_pattern / alpha_pattern giving that module r and alpha = r (scaling 1, the scaling being
in B). `HF_PARENTS` (data) names the parent module of an HF module name in transformers' models.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from bestiary.core.format.checkpoint import atomic_directory
from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora import trtllm_tensors
from bestiary.core.lora.adapter import LoraSource, _parse_targets, _tensor_names, _weight_file, read_peft
from bestiary.core.lora.modules import MODULE_IDS
from bestiary.registry import ArchitectureSpec, Registry

# HF module name -> its parent module inside a decoder layer (transformers' names); "" = the layer itself.
HF_PARENTS: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "out_proj": "self_attn", "qkv_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "gate_up_proj": "mlp",
    "query_key_value": "self_attention", "dense": "self_attention",
    "dense_h_to_4h": "mlp", "dense_4h_to_h": "mlp", "fc1": "", "fc2": "",
}


def source_rows(source: LoraSource) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(module_id, layer, A, s * B) per module of `source`, sorted by (layer, module id)."""
    rows = []
    for m in source.modules:
        if len(m.modules) != 1:
            raise BestiaryError(f"{m.where}: feeds {' and '.join(m.modules)} at once; a TensorRT-LLM LoRA tensor row "
                                "holds one module")
        if m.expert >= 0:
            raise BestiaryError(f"{m.where}: a MoE expert adapter; TensorRT-LLM LoRA tensor rows name no expert")
        rows.append((MODULE_IDS[m.modules[0]], m.layer, m.a, m.b.float() * m.scaling))
    return sorted(rows, key=lambda r: (r[1], r[0]))


def peft_to_trtllm(directory: str | Path, spec: ArchitectureSpec, registry: Registry,
                 dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM's (weights [M, W], config [M, 3]) of the PEFT adapter in `directory`."""
    return trtllm_tensors.pack_rows(source_rows(read_peft(directory, spec, registry)), dtype)


def guess_architecture(directory: str | Path, registry: Registry) -> ArchitectureSpec:
    """The architecture a PEFT dir was made for, from its module paths: the architectures whose
    LoRA data take every one must agree on the LoRA modules they feed (else: give --architecture)."""
    directory = Path(directory)
    file = _weight_file(directory)
    names = _tensor_names(file)
    found: dict[str, tuple] = {}
    for spec in registry.specs.values():
        if not spec.lora.hf_modules:
            continue
        try:
            targets = _parse_targets(names, spec, registry, file, None)
        except BestiaryError:
            continue
        found[spec.name] = tuple(sorted((p, t.layer, str(spec.lora.hf_modules[t.hf_name])) for p, t in targets.items()))
    if not found:
        raise BestiaryError(f"{file}: no registered architecture takes these LoRA modules; give --architecture")
    if len(set(found.values())) > 1:
        raise BestiaryError(f"{file}: the modules fit {', '.join(sorted(found))} differently; give --architecture")
    return registry.get(min(found))


def hf_name_of(spec: ArchitectureSpec, module: str) -> str:
    """The HF module name that feeds LoRA module `module` alone (the TensorRT-LLM -> PEFT direction)."""
    for name, value in spec.lora.hf_modules.items():
        if value == module or value == (module,):
            return name
    raise BestiaryError(f"LoRA module {module}: {spec.name} has no HF module that feeds it alone "
                        f"(its modules: {', '.join(spec.lora.hf_modules) or 'none'})")


def trtllm_to_peft(source: LoraSource, spec: ArchitectureSpec) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT adapter equal to the TensorRT-LLM rows in `source`."""
    layers = spec.lora.hf_layers[0]
    tensors: dict[str, torch.Tensor] = {}
    rank_pattern: dict[str, int] = {}
    names: set[str] = set()
    for m in source.modules:
        (module,) = m.modules
        hf = hf_name_of(spec, module)
        parent = HF_PARENTS.get(hf, "")
        path = ".".join(p for p in (layers, str(m.layer), parent, hf) if p)
        tensors[f"base_model.model.{path}.lora_A.weight"] = m.a.contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = (m.b.float() * m.scaling).to(m.b.dtype).contiguous()
        rank_pattern[path] = m.rank
        names.add(hf)
    r = max(rank_pattern.values())
    config = {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": sorted(names), "bias": "none",
              "rank_pattern": rank_pattern, "alpha_pattern": {p: float(k) for p, k in rank_pattern.items()},
              "task_type": "CAUSAL_LM"}
    return config, tensors


def write_files(directory: Path, files: dict[str, Callable[[Path], object]], flag: str = "--output_dir") -> Path:
    """Write `files` (name -> bytes-writer callable) as the LoRA conversion `directory`: new, empty, or an
    earlier bestiary LoRA conversion (core.format.output_dir's rule: it carries bestiary's marker),
    written into a temporary directory and renamed into place at the end: never a half-written output."""
    with atomic_directory(Path(directory), "lora", flag=flag) as tmp:
        for name, write in files.items():
            write(tmp / name)
    return Path(directory)


def write_trtllm(directory: Path, weights: torch.Tensor, config: torch.Tensor) -> Path:
    """hf_lora_convert.py's two .npy files ([1, M, W] and [1, M, 3])."""
    import numpy as np

    def npy(value):
        def write(path: Path) -> None:
            with open(path, "wb") as f:
                np.save(f, value.unsqueeze(0).numpy())
        return write

    return write_files(directory, {trtllm_tensors.WEIGHTS_FILE: npy(weights), trtllm_tensors.CONFIG_FILE: npy(config)})


def write_peft(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    return write_files(directory, {
        "adapter_config.json": lambda p: p.write_text(json.dumps(config, indent=2)),
        "adapter_model.safetensors": lambda p: save_file(tensors, str(p)),
    })
