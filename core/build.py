"""`bestiary build`: checkpoint dir -> engine dir (config with build limits, weights, tokenizer)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pydantic import Field

from bestiary.core.checkpoint import atomic_directory, rank_file, write_json
from bestiary.core.config import StrictModel, read_json
from bestiary.core.errors import BestiaryError

FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class BuildConfig(StrictModel):
    """Engine limits (trtllm-build names). Every field is a `bestiary build --flag`."""

    max_batch_size: int = Field(8, ge=1, description="Most sequences decoded in one step.")
    max_input_len: int | None = Field(None, ge=1, description="Longest prompt, in tokens (default: min(1024, max_seq_len - 1)).")
    max_seq_len: int | None = Field(None, ge=1, description="Longest prompt + output (default: the model's max positions).")
    max_num_tokens: int = Field(4096, ge=1, description="Most tokens (prefill + decode) in one step.")
    tokens_per_block: int = Field(32, ge=1, description="Tokens per paged KV cache block.")
    max_tokens_in_paged_kv_cache: int | None = Field(
        None, ge=1, description="KV pool size in tokens (default: max_batch_size * max_seq_len)."
    )


def finalize_build_config(build: BuildConfig, model_config: dict) -> BuildConfig:
    """Fill defaults that depend on the model and check the limits agree."""
    max_pos = model_config.get("max_position_embeddings") or 2048
    max_seq = build.max_seq_len or max_pos
    max_input = build.max_input_len or min(1024, max_seq - 1)
    if max_input >= max_seq:
        raise BestiaryError(f"--max_input_len {max_input}: must be smaller than --max_seq_len {max_seq}")
    return build.model_copy(update={"max_seq_len": max_seq, "max_input_len": max_input})


def build_engine(checkpoint_dir: str | Path, output_dir: str | Path, build: BuildConfig) -> Path:
    """Write an engine dir: config.json {format_version, pretrained_config, build_config}, rank files, tokenizer."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise BestiaryError(f"{checkpoint_dir}: no such checkpoint directory")
    model_config = read_json(checkpoint_dir / "config.json")
    if "pretrained_config" in model_config:
        raise BestiaryError(f"{checkpoint_dir}: is already an engine directory; pass a checkpoint from `bestiary convert`")
    from bestiary.core.engine import validate_model_config

    validate_model_config(model_config, str(checkpoint_dir / "config.json"))
    build = finalize_build_config(build, model_config)
    world = model_config.get("mapping", {}).get("world_size", 1)
    ranks = [rank_file(checkpoint_dir, r) for r in range(world)]
    for path in ranks:
        if not path.is_file():
            raise BestiaryError(f"{path}: rank file not found (mapping.world_size is {world})")
    with atomic_directory(Path(output_dir)) as tmp:
        for rank, path in enumerate(ranks):
            _link_or_copy(path, rank_file(tmp, rank))
        for name in TOKENIZER_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copy2(checkpoint_dir / name, tmp / name)
        write_json(tmp / "config.json", {
            "format_version": FORMAT_VERSION,
            "pretrained_config": model_config,
            "build_config": build.model_dump(mode="json"),
        })
    return Path(output_dir)


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when on the same filesystem (instant, no extra space), copy otherwise."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
