"""`bestiary convert --lora_dir` (PEFT dir <-> TensorRT-LLM's LoRA tensors) and `bestiary build --lora_dir`
(adapters bundled in the engine, core.lora.bundle).

convert: a PEFT dir becomes hf_lora_convert.py's two .npy files (architecture from --architecture
or from the adapter's module paths); a dir of those files becomes a PEFT dir, with the base model
(--model_dir, a checkpoint or engine dir) giving the architecture and each module's shape. The
output dir follows the one rule of core.format.output_dir: new, empty, or an earlier bestiary LoRA
conversion (marked by its `.bestiary-output` file), never a PEFT adapter or any other dir of yours.

build: every --lora_dir adapter is read, checked against the model (placed on a meta-device
rank: every shape and target), against --max_lora_rank and --lora_target_modules, and stored
as lora/<uid>.safetensors (TensorRT-LLM's LoRA tensors in the checkpoint's dtype).
"""

from __future__ import annotations

from pathlib import Path

import torch

from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.output_dir import check_output_dir
from bestiary.core.lora import trtllm_convert, trtllm_tensors
from bestiary.core.lora.adapter import LoraSource, module_dims, place, read_peft
from bestiary.core.lora.bundle import LORA_DIR, BundledAdapter, LoraBuildConfig
from bestiary.core.lora.modules import MODULE_IDS
from bestiary.registry import Registry, default_registry


def meta_model(directory: str | Path, registry: Registry):
    """Rank 0 of the model of a checkpoint or engine dir, on the meta device (shapes only)."""
    from bestiary.core.convert.source_to_checkpoint import instantiate
    from bestiary.core.runtime.engine import validate_model_config

    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise BestiaryError(f"--model_dir {directory}: no config.json (expected a bestiary checkpoint or engine dir)")
    data = read_json(config_file)
    config = validate_model_config(data.get("pretrained_config", data), str(config_file), registry)
    with torch.device("meta"):
        return instantiate(registry.get(config.architecture), config, 0)


def convert_lora(lora_dir: str | Path, output_dir: str | Path, storage_type: str = "float16",
                 architecture: str | None = None, model_dir: str | Path | None = None,
                 registry: Registry | None = None) -> Path:
    """PEFT dir -> TensorRT-LLM .npy files, or TensorRT-LLM .npy files -> PEFT dir (the module docstring)."""
    registry = registry or default_registry()
    lora_dir = Path(lora_dir)
    # before anything is read: a new or empty dir, or an earlier bestiary LoRA conversion (core.format.output_dir)
    check_output_dir(output_dir, "lora", [lora_dir, *([model_dir] if model_dir is not None else [])])
    if trtllm_tensors.is_trtllm_dir(lora_dir):
        if model_dir is None:
            raise BestiaryError(f"--lora_dir {lora_dir}: TensorRT-LLM LoRA tensors; give the base model's checkpoint or "
                                "engine dir with --model_dir (their shapes and module names)")
        model = meta_model(model_dir, registry)
        weights, config = trtllm_tensors.load(lora_dir)
        source = trtllm_tensors.read_rows(weights, config, lambda m, i: module_dims(model, m, i), lora_dir.name)
        place(source, model, registry)  # every row checked against the model
        spec = registry.get(model.config.architecture)
        return trtllm_convert.write_peft(Path(output_dir), *trtllm_convert.trtllm_to_peft(source, spec))
    if storage_type not in trtllm_tensors.STORAGE_DTYPES:
        raise BestiaryError(f"--storage_type {storage_type}: expected one of {', '.join(trtllm_tensors.STORAGE_DTYPES)} "
                            "(numpy has no bfloat16)")
    spec = registry.get(architecture) if architecture else trtllm_convert.guess_architecture(lora_dir, registry)
    rows, row_config = trtllm_convert.peft_to_trtllm(lora_dir, spec, registry,
                                                    trtllm_tensors.STORAGE_DTYPES[storage_type])
    return trtllm_convert.write_trtllm(Path(output_dir), rows, row_config)


def bundle_adapters(checkpoint_dir: Path, out: Path, lora_dirs: list[str], max_lora_rank: int | None,
                    target_modules: list[str] | None, registry: Registry | None = None) -> dict:
    """Write lora/<uid>.safetensors into `out` (an engine being built) for each adapter of
    `lora_dirs`; config.json's "lora" section (LoraBuildConfig) returned."""
    from safetensors.torch import save_file

    registry = registry or default_registry()
    model = meta_model(checkpoint_dir, registry)
    spec = registry.get(model.config.architecture)
    dtype = next(model.parameters()).dtype
    allowed = _target_modules(target_modules, spec)
    sources = [read_peft(d, spec, registry, model.config.num_hidden_layers) for d in lora_dirs]
    max_rank = max_lora_rank or max(m.rank for s in sources for m in s.modules)
    adapters = []
    (out / LORA_DIR).mkdir()
    for uid, (directory, source) in enumerate(zip(lora_dirs, sources)):
        _check_limits(directory, source, max_rank, allowed)
        place(source, model, registry)  # shapes against the model
        weights, config = trtllm_tensors.pack_rows(trtllm_convert.source_rows(source), dtype)
        file = f"{LORA_DIR}/{uid}.safetensors"
        save_file({"lora_weights": weights, "lora_config": config}, str(out / file))
        modules = sorted({m for w in source.modules for m in w.modules}, key=MODULE_IDS.__getitem__)
        adapters.append(BundledAdapter(task_uid=str(uid), name=Path(directory).name, file=file, modules=modules,
                                       max_rank=max(m.rank for m in source.modules)))
    return LoraBuildConfig(max_lora_rank=max_rank, lora_target_modules=sorted(allowed, key=MODULE_IDS.__getitem__),
                           adapters=adapters).model_dump(mode="json")


def _target_modules(names: list[str] | None, spec) -> set[str]:
    """--lora_target_modules as LoRA module names (default: every module the architecture takes)."""
    if not names:
        return set(spec.lora.modules)
    for name in names:
        if name not in MODULE_IDS:
            raise BestiaryError(f"--lora_target_modules {name}: unknown LoRA module; expected one of "
                                f"{', '.join(MODULE_IDS)}")
        if name not in spec.lora.modules:
            raise BestiaryError(f"--lora_target_modules {name}: {spec.name} takes only "
                                f"{', '.join(spec.lora.modules) or 'no LoRA modules'}")
    return set(names)


def _check_limits(directory: str, source: LoraSource, max_rank: int, allowed: set[str]) -> None:
    """Refuse a rank above --max_lora_rank and a module outside --lora_target_modules (one line)."""
    for weights in source.modules:
        if weights.rank > max_rank:
            raise BestiaryError(f"--lora_dir {directory}: {weights.hf_path} has rank {weights.rank}, above "
                                f"--max_lora_rank {max_rank}")
        outside = [m for m in weights.modules if m not in allowed]
        if outside:
            raise BestiaryError(f"--lora_dir {directory}: {weights.hf_path} adapts {outside[0]}, which is not in "
                                f"--lora_target_modules ({', '.join(sorted(allowed, key=MODULE_IDS.__getitem__))})")
