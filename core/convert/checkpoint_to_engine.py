"""`bestiary build`: checkpoint dir -> engine dir (config with build limits, weights, tokenizer)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bestiary.core.convert.memory import check_build_memory
from bestiary.core.format.build_config import (
    FORMAT_VERSION,
    TOKENIZER_FILES,
    BuildConfig,
    finalize_build_config,
)
from bestiary.core.format.checkpoint import atomic_directory, rank_file, write_json
from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.output_dir import check_output_dir

__all__ = ["FORMAT_VERSION", "BuildConfig", "build_engine", "finalize_build_config"]


def build_engine(checkpoint_dir: str | Path, output_dir: str | Path, build: BuildConfig,
                 check_memory: bool = True, lora_dirs: list[str] | None = None, max_lora_rank: int | None = None,
                 lora_target_modules: list[str] | None = None) -> Path:
    """Write an engine dir: config.json {format_version, pretrained_config, build_config}, rank files, tokenizer.

    Limits run cannot use (max_seq_len < 2, tokens_per_block past 1024, ...) are refused
    (core.format.build_config.finalize_build_config). `check_memory`: refuse limits whose KV pool and
    weights exceed the memory this process could use on this host (core.convert.memory).
    `lora_dirs`: PEFT adapters bundled as task uids 0, 1, ... (config.json "lora", lora/: core.lora.bundle),
    each checked against `max_lora_rank` and `lora_target_modules` (TensorRT-LLM's build flags)."""
    checkpoint_dir = Path(checkpoint_dir)
    check_output_dir(output_dir, "engine", [checkpoint_dir])
    if not checkpoint_dir.is_dir():
        raise BestiaryError(f"{checkpoint_dir}: no such checkpoint directory")
    model_config = read_json(checkpoint_dir / "config.json")
    if "pretrained_config" in model_config:
        raise BestiaryError(f"{checkpoint_dir}: is already an engine directory; pass a checkpoint from `bestiary convert`")
    from bestiary.core.runtime.engine import validate_model_config

    config = validate_model_config(model_config, str(checkpoint_dir / "config.json"))
    build = finalize_build_config(build, model_config, str(checkpoint_dir / "config.json"))
    world = config.mapping.world_size
    ranks = [rank_file(checkpoint_dir, r) for r in range(world)]
    for path in ranks:
        if not path.is_file():
            raise BestiaryError(f"{path}: rank file not found (mapping.world_size is {world})")
    if check_memory:
        check_build_memory(config, build, max(p.stat().st_size for p in ranks))
    with atomic_directory(Path(output_dir), "engine", [checkpoint_dir]) as tmp:
        for rank, path in enumerate(ranks):
            _link_or_copy(path, rank_file(tmp, rank))
        for name in TOKENIZER_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copy2(checkpoint_dir / name, tmp / name)
        engine_config = {
            "format_version": FORMAT_VERSION,
            "pretrained_config": model_config,
            "build_config": build.model_dump(mode="json"),
        }
        if lora_dirs or max_lora_rank or lora_target_modules:
            if not lora_dirs:
                raise BestiaryError("--max_lora_rank / --lora_target_modules: give the adapters with --lora_dir")
            from bestiary.core.convert.lora_convert import bundle_adapters

            engine_config["lora"] = bundle_adapters(checkpoint_dir, tmp, lora_dirs, max_lora_rank, lora_target_modules)
        write_json(tmp / "config.json", engine_config)
    return Path(output_dir)


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when on the same filesystem (instant, no extra space), copy otherwise."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
