"""TensorRT-LLM's per-request LoRA tensors: LoraWeights and LoraConfig.

    lora_config  [M, 3] int       row j = (module_id, layer_idx, D)   (a 4th column, DoRA, must be 0)
    lora_weights [M, W] float     row j = [ A_j.flatten() | B_j.flatten() | padding ],
                                  A_j [D, Hi] (in weights), B_j [Ho, D] (out weights), W >= D*Hi + Ho*D

Hi / Ho are module j's full input / output sizes (every TP and PP rank's weights; the runtime cuts
its rank's part). The scaling is folded into B (B = s * lora_B, as hf_lora_convert.py writes it),
so a row reads delta = B (A x). B's rows are in the HF module's order (a fused HF source goes
through the architecture's postprocess like a PEFT lora_B). A leading batch dimension of 1 (what
hf_lora_convert.py saves) is accepted.

On disk (`bestiary convert --lora_dir`, hf_lora_convert.py's names): `model.lora_weights.npy` and
`model.lora_config.npy` in one directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.adapter import LoraSource, ModuleWeights
from bestiary.core.lora.modules import LANDINGS, MODULE_IDS

WEIGHTS_FILE = "model.lora_weights.npy"
CONFIG_FILE = "model.lora_config.npy"
_NAMES = {v: k for k, v in MODULE_IDS.items()}
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16}

Dims = Callable[[str, int], tuple[int, int]]  # (module name, layer) -> (Hi, Ho), full sizes


def as_tensor(value: Any, what: str) -> torch.Tensor:
    """A numpy array or torch tensor as a CPU torch tensor (anything else: a one-line error)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise BestiaryError(f"LoRA {what}: expected a numpy array or torch tensor, got {type(value).__name__}")


def _squeeze(t: torch.Tensor, dims: int, what: str, shape: str) -> torch.Tensor:
    if t.dim() == dims + 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != dims:
        raise BestiaryError(f"LoRA {what}: shape {tuple(t.shape)}, expected {shape}")
    return t


def read_rows(weights: Any, config: Any, dims: Dims, name: str = "lora") -> LoraSource:
    """TensorRT-LLM's (lora_weights, lora_config) as a LoraSource: one module per row, scaling 1.

    `dims(module, layer)` gives the model's full (Hi, Ho) of that module; rows are checked
    against it and against the row width (errors name the row)."""
    w = _squeeze(as_tensor(weights, "weights"), 2, "weights", "[num_module_layers, D*Hi + Ho*D]")
    c = _squeeze(as_tensor(config, "config"), 2, "config", "[num_module_layers, 3]")
    if c.shape[1] not in (3, 4) or c.shape[0] != w.shape[0]:
        raise BestiaryError(f"LoRA config: shape {tuple(c.shape)}, expected [{w.shape[0]}, 3] (one row per weights row)")
    if c.is_floating_point():
        raise BestiaryError(f"LoRA config: dtype {c.dtype}, expected integers (module_id, layer_idx, adapter_size)")
    if not w.is_floating_point():
        raise BestiaryError(f"LoRA weights: dtype {w.dtype}, expected a float dtype")
    seen: set[tuple[int, int]] = set()
    modules = []
    for j, (module_id, layer, rank, *dora) in enumerate(c.tolist()):
        where = f"LoRA config row {j} ({module_id}, {layer}, {rank})"
        module = _NAMES.get(module_id)
        if module is None:
            raise BestiaryError(f"{where}: unknown module id {module_id}; expected 0-{max(_NAMES)}")
        if dora and dora[0]:
            raise BestiaryError(f"{where}: DoRA rows are not supported")
        if LANDINGS[module].kind == "expert":
            raise BestiaryError(f"{where}: {module} names no expert; MoE expert adapters need a PEFT dir")
        if rank < 1 or layer < 0:
            raise BestiaryError(f"{where}: expected layer_idx >= 0 and adapter size >= 1")
        if (module_id, layer) in seen:
            raise BestiaryError(f"{where}: {module} of layer {layer} is given twice")
        seen.add((module_id, layer))
        hi, ho = dims(module, layer)
        need = rank * hi + ho * rank
        if need > w.shape[1]:
            raise BestiaryError(f"{where}: {module} of rank {rank} needs {need} values (D*Hi + Ho*D = {rank}*{hi} + "
                                f"{ho}*{rank}), but a weights row has {w.shape[1]}")
        a = w[j, : rank * hi].reshape(rank, hi)  # [D, Hi]
        b = w[j, rank * hi : need].reshape(ho, rank)  # [Ho, D]
        modules.append(ModuleWeights((module,), layer, -1, a.clone(), b.clone(), 1.0, where))
    return LoraSource(name, None, modules)


def pack_rows(rows: list[tuple[int, int, torch.Tensor, torch.Tensor]], dtype: torch.dtype = torch.float16
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(module_id, layer, A [D, Hi], B [Ho, D] with the scaling folded in) per row -> (weights [M, W]
    in `dtype`, each row zero-padded to the longest, config [M, 3] int32)."""
    flat = [torch.cat([a.reshape(-1), b.reshape(-1)]).to(torch.float32) for _, _, a, b in rows]
    width = max(f.numel() for f in flat)
    weights = torch.zeros(len(rows), width, dtype=dtype)
    for j, f in enumerate(flat):
        weights[j, : f.numel()] = f.to(dtype)
    config = torch.tensor([[mid, layer, a.shape[0]] for mid, layer, a, _ in rows], dtype=torch.int32).reshape(-1, 3)
    return weights, config


def is_trtllm_dir(directory: Path) -> bool:
    return (directory / WEIGHTS_FILE).is_file() and (directory / CONFIG_FILE).is_file()


def load(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """(weights, config) of a directory written by `save` or hf_lora_convert.py."""
    out = []
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        try:
            out.append(np.load(directory / name, allow_pickle=False))
        except (OSError, ValueError) as err:
            raise BestiaryError(f"{directory / name}: not a readable .npy file ({str(err).splitlines()[0]})") from None
    return out[0], out[1]
