"""The engine's build configuration (limits), shared by `bestiary build` and the runtime.

Light on purpose (no torch): the CLI builds its `build` flags from this schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from bestiary.core.format.config import StrictModel
from bestiary.core.format.errors import BestiaryError

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
    max_attention_window: int | None = Field(
        None, ge=1, description="Every query attends to at most this many recent keys (sinks included), in every "
                                "layer; blocks past it are released (default: the model's own windows, else all).")
    sink_token_length: int = Field(
        0, ge=0, description="The first tokens of a sequence every windowed query keeps attending to (attention "
                             "sinks); must be smaller than the window.")


def finalize_build_config(build: BuildConfig, model_config: dict[str, Any]) -> BuildConfig:
    """Fill defaults that depend on the model and check the limits agree."""
    max_pos = model_config.get("max_position_embeddings") or 2048
    max_seq = build.max_seq_len or max_pos
    if max_seq > max_pos:
        raise BestiaryError(f"--max_seq_len {max_seq}: exceeds the model's max_position_embeddings {max_pos}")
    window, sinks = build.max_attention_window, build.sink_token_length
    if sinks and window is not None and sinks >= window:
        raise BestiaryError(f"--sink_token_length {sinks}: must be smaller than --max_attention_window {window}")
    if sinks and window is None and not model_config.get("sliding_window"):
        raise BestiaryError(f"--sink_token_length {sinks}: needs --max_attention_window (the model has no sliding_window)")
    max_input = build.max_input_len or min(1024, max_seq - 1)
    if max_input >= max_seq:
        raise BestiaryError(f"--max_input_len {max_input}: must be smaller than --max_seq_len {max_seq}")
    return build.model_copy(update={"max_seq_len": max_seq, "max_input_len": max_input})
